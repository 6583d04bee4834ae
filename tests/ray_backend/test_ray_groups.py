"""plait as a Ray collective backend, with a real Ray: groups of 2-3 actors, checked against numpy.

One Ray instance (on loopback, 2 CPUs, no dashboard) serves the module; the
actors are made once and belong to several groups. The last test kills an
actor mid-call, so it runs last and replaces the actor.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="plait.ray needs Ray: pip install 'plait[ray]'")

import plait  # noqa: E402

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(240),
    # Ray's own modules warn about deprecated APIs of their dependencies on import
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

SIZE = 3


def inputs(rank: int, size: int) -> dict[str, Any]:
    """Rank ``rank``'s inputs, the same on the actor and in the test."""
    rng = np.random.default_rng(1000 + rank)
    return {
        "f64": rng.standard_normal((5, 3)),
        "i32": rng.integers(-100, 100, size=7).astype(np.int32),
        "small": rng.integers(1, 4, size=6).astype(np.int64),
        "f32": rng.standard_normal(8).astype(np.float32),
        "parts": [rng.standard_normal(4) for _ in range(size)],
        "rows": rng.standard_normal((size, 2)),
    }


@ray.remote(num_cpus=0)
class Member:
    """An actor in plait groups; its methods run Ray's collective API."""

    def __init__(self) -> None:
        import plait.ray  # noqa: F401 - registers the backend in this process

    def ready(self) -> None:
        """Returns once the actor's process has started (and imported plait): a join timed
        with its members then counts the join only, not Ray starting a worker."""

    def join(self, size: int, rank: int, name: str) -> None:
        import ray.util.collective as col

        col.init_collective_group(size, rank, backend="plait", group_name=name)

    def destroy(self, name: str) -> None:
        import ray.util.collective as col

        col.destroy_collective_group(name)

    def token(self, name: str) -> str:
        from ray.util.collective.collective import get_group_handle

        return str(get_group_handle(name)._meeting.token)

    def allreduce(self, name: str, value: float) -> Any:
        import ray.util.collective as col

        x = np.full(4, value)
        col.allreduce(x, group_name=name)
        return x

    def barrier_alone(self, name: str, ms: int) -> float | None:
        """A barrier no other member enters, with Ray's BarrierOptions.timeout_ms set to ``ms``:
        the seconds until it timed out (None: it returned)."""
        import ray.util.collective as col
        from ray.util.collective import types

        before = types.BarrierOptions.timeout_ms
        types.BarrierOptions.timeout_ms = ms
        start = time.monotonic()
        try:
            col.barrier(group_name=name)
        except plait.CommTimeout:
            return time.monotonic() - start
        finally:
            types.BarrierOptions.timeout_ms = before
        return None

    def block_in_recv(self, name: str, src: int) -> None:
        import ray.util.collective as col

        col.recv(np.zeros(4), src, group_name=name)

    def run_all(self, name: str) -> dict[str, Any]:
        """Every collective Ray defines, and plait's extras, on this rank's inputs."""
        import ray.util.collective as col
        import torch
        from ray.util.collective.types import ReduceOp

        import plait.ray

        rank, size = col.get_rank(name), col.get_collective_group_size(name)
        data = inputs(rank, size)
        out: dict[str, Any] = {}
        x = data["f64"].copy()
        col.allreduce(x, group_name=name)
        out["allreduce_sum"] = x
        x = data["i32"].copy()
        col.allreduce(x, group_name=name, op=ReduceOp.MAX)
        out["allreduce_max"] = x
        x = data["small"].copy()
        col.allreduce(x, group_name=name, op=ReduceOp.PRODUCT)
        out["allreduce_prod"] = x
        x = data["i32"].copy()
        col.allreduce(x, group_name=name, op=ReduceOp.MIN)
        out["allreduce_min"] = x
        t = torch.from_numpy(data["f32"].copy())
        col.allreduce(t, group_name=name)
        out["allreduce_torch"] = t.numpy()
        x = data["f64"].copy()
        col.reduce(x, dst_rank=1, group_name=name)
        out["reduce"] = x
        x = data["f64"].copy()
        col.broadcast(x, src_rank=2 % size, group_name=name)
        out["broadcast"] = x
        gathered = [np.zeros(7, np.int32) for _ in range(size)]
        col.allgather(gathered, data["i32"], group_name=name)
        out["allgather"] = np.stack(gathered)
        target = np.zeros(4)
        col.reducescatter(target, [p.copy() for p in data["parts"]], group_name=name)
        out["reducescatter"] = target
        # bfloat16 tensors, read as allreduce reads them (ml_dtypes' bfloat16)
        bf16 = torch.full((3,), rank + 1.0, dtype=torch.bfloat16)
        parts = [torch.zeros(3, dtype=torch.bfloat16) for _ in range(size)]
        col.allgather(parts, bf16, group_name=name)
        out["allgather_bf16"] = torch.stack(parts).float().numpy()
        mine = torch.zeros(3, dtype=torch.bfloat16)
        col.reducescatter(mine, [bf16.clone() for _ in range(size)], group_name=name)
        out["reducescatter_bf16"] = mine.float().numpy()
        chain = data["f64"].copy()
        if rank > 0:
            col.recv(chain, rank - 1, group_name=name)
        if rank < size - 1:
            col.send(chain, rank + 1, group_name=name)
        out["chain"] = chain
        col.barrier(group_name=name)
        comm = plait.ray.communicator(name)
        out["gather"] = comm.gather(data["f32"], root=0)
        out["scatter"] = comm.scatter(data["rows"], root=1)
        out["alltoall"] = comm.alltoall(data["rows"])
        out["objects"] = comm.allgather_object({"rank": rank})
        return out


@pytest.fixture(scope="module")
def members() -> Iterator[list[Any]]:
    """The module's one Ray instance and its actors (shut down, with every process, at the end)."""
    # The actor class and helpers travel by value: workers cannot import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PLAIT_TIMEOUT": "60"}},
    )
    try:
        actors = [Member.remote() for _ in range(SIZE)]
        ray.get([a.ready.remote() for a in actors], timeout=300)
        ray.get([a.join.remote(SIZE, r, "all") for r, a in enumerate(actors)], timeout=120)
        yield actors
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_every_collective_matches_numpy(members: list[Any]) -> None:
    results = ray.get([a.run_all.remote("all") for a in members], timeout=120)
    data = [inputs(r, SIZE) for r in range(SIZE)]
    for rank, got in enumerate(results):
        np.testing.assert_allclose(got["allreduce_sum"], sum(d["f64"] for d in data))
        np.testing.assert_array_equal(got["allreduce_max"], np.max([d["i32"] for d in data], 0))
        np.testing.assert_array_equal(got["allreduce_prod"], np.prod([d["small"] for d in data], 0))
        np.testing.assert_array_equal(got["allreduce_min"], np.min([d["i32"] for d in data], 0))
        np.testing.assert_allclose(got["allreduce_torch"], sum(d["f32"] for d in data), rtol=1e-6)
        expect = sum(d["f64"] for d in data) if rank == 1 else data[rank]["f64"]
        np.testing.assert_allclose(got["reduce"], expect)
        np.testing.assert_array_equal(got["broadcast"], data[2]["f64"])
        np.testing.assert_array_equal(got["allgather"], np.stack([d["i32"] for d in data]))
        np.testing.assert_allclose(got["reducescatter"], sum(d["parts"][rank] for d in data))
        np.testing.assert_array_equal(got["allgather_bf16"], [[r + 1.0] * 3 for r in range(SIZE)])
        np.testing.assert_array_equal(got["reducescatter_bf16"], [SIZE * (SIZE + 1) / 2] * 3)
        np.testing.assert_array_equal(got["chain"], data[0]["f64"])
        if rank == 0:
            np.testing.assert_array_equal(got["gather"], np.stack([d["f32"] for d in data]))
        else:
            assert got["gather"] is None
        np.testing.assert_array_equal(got["scatter"], data[1]["rows"][rank : rank + 1])
        np.testing.assert_array_equal(got["alltoall"], np.stack([d["rows"][rank] for d in data]))
        assert got["objects"] == [{"rank": r} for r in range(SIZE)]


def test_driver_declared_group_beside_another(members: list[Any]) -> None:
    import ray.util.collective as col

    import plait.ray  # noqa: F401 - the driver checks the backend is registered

    pair = members[:2]
    col.create_collective_group(pair, 2, [1, 0], backend="plait", group_name="pair")
    # created lazily by Ray at the first call; the actors stay members of "all" too
    got = ray.get(
        [a.allreduce.remote("pair", v) for a, v in zip(pair, (1.0, 2.0), strict=True)], timeout=60
    )
    for g in got:
        np.testing.assert_array_equal(g, np.full(4, 3.0))
    got = ray.get([a.allreduce.remote("all", 1.0) for a in members], timeout=60)
    np.testing.assert_array_equal(got[0], np.full(4, 3.0))
    ray.get([a.destroy.remote("pair") for a in pair], timeout=60)


def test_a_group_created_again_meets_afresh(members: list[Any]) -> None:
    pair = members[1:]
    tokens = []
    for _ in range(2):
        ray.get([a.join.remote(2, r, "again") for r, a in enumerate(pair)], timeout=60)
        got = ray.get([a.allreduce.remote("again", 1.5) for a in pair], timeout=60)
        np.testing.assert_array_equal(got[1], np.full(4, 3.0))
        tokens.append(set(ray.get([a.token.remote("again") for a in pair], timeout=60)))
        ray.get([a.destroy.remote("again") for a in pair], timeout=60)
    assert len(tokens[0]) == len(tokens[1]) == 1
    assert tokens[0] != tokens[1]
    from plait.ray import RayKeyValue, group_namespace

    job = ray.get_runtime_context().get_job_id()
    assert RayKeyValue(group_namespace(job, "again")).keys("") == []  # nothing left behind


def test_barrier_times_out_as_ray_barrier_options_say(members: list[Any]) -> None:
    # ray.util.collective.barrier passes the group no options; BarrierOptions still apply.
    pair = members[:2]
    ray.get([a.join.remote(2, r, "barrier") for r, a in enumerate(pair)], timeout=60)
    waited = ray.get(pair[0].barrier_alone.remote("barrier", 300), timeout=30)
    assert waited is not None
    assert waited < 10  # 0.3 s, not the actors' PLAIT_TIMEOUT of 60 s
    ray.get([a.destroy.remote("barrier") for a in pair], timeout=60)


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's per-worker loop: a few DDP steps of a small model on different data per rank."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for _ in range(config["steps"]):
        x = torch.randn(8, 4, generator=data)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    same = all(torch.equal(everyone[0], e) for e in everyone)
    # Ray Train keeps reported metrics with checkpoints only: each worker writes its own.
    with open(f"{config['out']}/rank{rank}.json", "w") as f:
        json.dump({"backend": dist.get_backend(), "same": same, "loss": float(loss)}, f)


@pytest.mark.slow  # Ray Train starts a controller and a worker group: about 15-30 s
def test_ray_train_ddp_on_the_plait_torch_backend(members: list[Any], tmp_path: Any) -> None:
    pytest.importorskip("torch", reason="Ray Train's TorchTrainer needs torch")
    train = pytest.importorskip("ray.train", reason="needs Ray Train: pip install 'ray[train]'")
    from ray.train.torch import TorchTrainer

    from plait.ray.train import PlaitTorchConfig

    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"steps": 5, "out": str(tmp_path)},
        torch_config=PlaitTorchConfig(timeout_s=60),
        scaling_config=train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=train.RunConfig(storage_path=str(tmp_path), name="plait"),
    )
    result = trainer.fit()
    assert result.error is None
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["backend"] == "plait"
        assert got["same"] is True  # DDP kept the replicas equal


def test_killed_member_makes_the_others_raise_peer_lost(members: list[Any]) -> None:
    ray.get([a.join.remote(SIZE, r, "victim") for r, a in enumerate(members)], timeout=60)
    blocked = members[2].block_in_recv.remote("victim", 0)
    calls = [a.allreduce.remote("victim", 1.0) for a in members[:2]]
    ray.kill(members[2])
    start = time.monotonic()
    for ref in calls:
        with pytest.raises(plait.PeerLostError):
            ray.get(ref, timeout=60)
    assert time.monotonic() - start < 20
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(blocked, timeout=60)
    # The survivors destroy the group and create it again with a fresh member.
    ray.get([a.destroy.remote("victim") for a in members[:2]], timeout=60)
    members[2] = Member.remote()
    ray.get(members[2].ready.remote(), timeout=300)  # the others wait at most PLAIT_TIMEOUT
    ray.get([a.join.remote(SIZE, r, "victim") for r, a in enumerate(members)], timeout=60)
    got = ray.get([a.allreduce.remote("victim", 2.0) for a in members], timeout=60)
    np.testing.assert_array_equal(got[2], np.full(4, 6.0))
