"""Bucketer steps that go wrong: what an error leaves, and how the next step begins.

See Note [a step under attach] and Note [what a failed step leaves] in plait.bucketing.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import numpy as np
import pytest

import plait
from plait.bucketing import Bucketer, attach
from plait.testing import run_ranks

torch = pytest.importorskip("torch")


def model_and_inputs(ranks: int, batches: int) -> tuple[Any, list[list[Any]]]:
    """One model (copied per rank: torch's RNG is shared by threads) and each rank's batches."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    rng = np.random.default_rng(7)
    inputs = [
        [torch.from_numpy(rng.standard_normal((4, 6))).float() for _ in range(batches)]
        for _ in range(ranks)
    ]
    return base, inputs


def local_grads(base: Any, batches: list[Any]) -> list[np.ndarray]:
    """One rank's gradients, summed over ``batches``, without any communication."""
    model = copy.deepcopy(base)
    for x in batches:
        model(x).square().sum().backward()
    return [p.grad.numpy().copy() for p in model.parameters()]


def check_averaged(out: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> None:
    """Each rank's gradients are the ranks' average of ``want``, bit-identical across ranks."""
    for i in range(len(want[0])):
        mean = sum(w[i] for w in want) / len(want)
        np.testing.assert_allclose(out[0][i], mean, rtol=1e-5, atol=1e-6)
        for got in out[1:]:
            assert got[i].tobytes() == out[0][i].tobytes()


# -- gradient accumulation -------------------------------------------------------------------
def test_a_second_backward_in_a_step_is_refused_once_and_the_next_step_works() -> None:
    """Two backward passes before finish() raised "gradient 3 was already marked ready", and
    so did every later step: the gradients handed over stayed marked."""
    base, inputs = model_and_inputs(2, 3)

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        model = copy.deepcopy(base)
        finish = attach(model, comm, bucket_bytes=64)  # several buckets, started in backward
        model(inputs[comm.rank][0]).square().sum().backward()
        with pytest.raises(ValueError, match="gradient") as info:
            model(inputs[comm.rank][1]).square().sum().backward()
        for _ in range(2):  # the next steps work
            model.zero_grad()
            model(inputs[comm.rank][2]).square().sum().backward()
            finish()
        said = str(info.value)
        assert "second gradient before finish()" in said
        assert "this step was dropped" in said
        assert "`with finish.no_sync():`" in said  # how to accumulate
        return [p.grad.numpy().copy() for p in model.parameters()]

    check_averaged(run_ranks(2, body), [local_grads(base, inputs[r][2:]) for r in range(2)])


def test_no_sync_accumulates_gradients_over_backward_passes() -> None:
    """DDP's way: every backward of a step but the last inside ``no_sync()``."""
    base, inputs = model_and_inputs(2, 3)

    def body(comm: plait.Communicator) -> list[list[np.ndarray]]:
        model = copy.deepcopy(base)
        finish = attach(model, comm, bucket_bytes=64)
        seen = []
        for _ in range(2):
            model.zero_grad()
            with finish.no_sync():
                for x in inputs[comm.rank][:-1]:
                    model(x).square().sum().backward()
            model(inputs[comm.rank][-1]).square().sum().backward()
            finish()
            seen.append([p.grad.numpy().copy() for p in model.parameters()])
        return seen

    out = run_ranks(2, body)
    want = [local_grads(base, inputs[r]) for r in range(2)]
    for step in range(2):
        check_averaged([out[r][step] for r in range(2)], want)


def test_no_sync_is_refused_once_gradients_of_the_step_were_handed_over() -> None:
    base, inputs = model_and_inputs(1, 1)

    def body(comm: plait.Communicator) -> None:
        model = copy.deepcopy(base)
        finish = attach(model, comm)
        model(inputs[0][0]).sum().backward()
        refused = pytest.raises(ValueError, match=r"enter no_sync\(\) before the step's first")
        with refused, finish.no_sync():
            pass
        finish()
        with finish.no_sync():  # a new step: taken
            model(inputs[0][0]).sum().backward()

    run_ranks(1, body)


def test_a_backward_after_a_finish_that_timed_out_is_told_to_finish_first() -> None:
    """The step a finish(timeout) left running is not dropped: its allreduces go on, and the
    error says to call finish() again; after it, the next step works."""
    base, inputs = model_and_inputs(2, 1)
    late = threading.Event()

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        model = copy.deepcopy(base)
        finish = attach(model, comm)
        if comm.rank == 1:
            assert late.wait(30)  # rank 0's finish has timed out
        model(inputs[comm.rank][0]).square().sum().backward()
        if comm.rank == 0:
            try:
                with pytest.raises(plait.CommTimeout):
                    finish(timeout=0.2)
                with pytest.raises(ValueError, match=r"timed out; call finish\(\) again"):
                    model(inputs[0][0]).square().sum().backward()
            finally:
                late.set()
        finish()
        model.zero_grad()
        model(inputs[comm.rank][0]).square().sum().backward()
        finish()
        return [p.grad.numpy().copy() for p in model.parameters()]

    check_averaged(run_ranks(2, body), [local_grads(base, inputs[r]) for r in range(2)])


# -- sparse gradients --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_attach_refuses_a_module_that_makes_sparse_gradients(kind: str) -> None:
    """attach took it, and each backward then raised "gradient 0 has layout torch.sparse_coo"
    in a hook, after other buckets had started (Note [refused when built])."""
    layer = getattr(torch.nn, kind)

    def body(comm: plait.Communicator) -> None:
        model = torch.nn.ModuleDict(
            {"words": layer(10, 4, sparse=True), "head": torch.nn.Linear(4, 2)}
        )
        said = rf"module 'words', {kind}\(10, 4.*\), was made with sparse=True"
        with pytest.raises(TypeError, match=said):
            attach(model, comm)
        assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
        with pytest.raises(TypeError, match="sparse=False"):
            attach(layer(10, 4, sparse=True), comm)  # the module itself
        model["words"].weight.requires_grad_(False)  # a frozen one makes no gradient
        attach(model, comm)
        attach(layer(10, 4), comm)  # dense gradients

    run_ranks(1, body)


class Lookup(torch.nn.Module):
    """A table read through ``F.embedding`` (sparse gradients on request) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.arange(12.0).reshape(6, 2))
        self.head = torch.nn.Linear(2, 3)
        self.sparse = True

    def forward(self, idx: Any) -> Any:
        rows = torch.nn.functional.embedding(idx, self.table, sparse=self.sparse)
        return self.head(rows)


def test_a_sparse_gradient_refused_in_backward_drops_the_step() -> None:
    """A sparse gradient attach cannot see coming is refused in its hook; the head's
    gradients, handed over before it, stayed marked and every later step failed."""

    torch.manual_seed(0)
    base = Lookup()

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        model = copy.deepcopy(base)
        finish = attach(model, comm, bucket_bytes=8)  # the head's buckets start first
        idx = torch.tensor([comm.rank, 3])
        with pytest.raises(TypeError, match="sparse_coo") as info:
            model(idx).sum().backward()
        model.sparse = False
        model.zero_grad()
        model(idx).sum().backward()
        finish()
        assert "'table' got a torch.sparse_coo gradient" in str(info.value)
        assert "this step was dropped" in str(info.value)
        return [p.grad.numpy().copy() for p in model.parameters()]

    def local(rank: int) -> list[np.ndarray]:
        model = copy.deepcopy(base)
        model.sparse = False
        model(torch.tensor([rank, 3])).sum().backward()
        return [p.grad.numpy().copy() for p in model.parameters()]

    check_averaged(run_ranks(2, body), [local(r) for r in range(2)])


def test_a_gradient_a_hook_refuses_drops_the_step() -> None:
    """The first layer made float64 after attach: its gradients are refused (the Bucketer
    has float32 buffers) after the last layer's were handed over, and the step is dropped."""
    base, inputs = model_and_inputs(2, 1)

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        model = copy.deepcopy(base)
        finish = attach(model, comm, bucket_bytes=64)
        model[0].double()
        hidden = model[0](inputs[comm.rank][0].double()).float()
        with pytest.raises(ValueError, match="dtype float64; expected") as info:
            model[2](model[1](hidden)).square().sum().backward()
        model.float()
        model.zero_grad()
        model(inputs[comm.rank][0]).square().sum().backward()
        finish()
        assert "this step was dropped" in " ".join(getattr(info.value, "__notes__", []))
        return [p.grad.numpy().copy() for p in model.parameters()]

    check_averaged(run_ranks(2, body), [local_grads(base, inputs[r]) for r in range(2)])


def test_a_bucketer_refused_a_second_gradient_says_how_to_accumulate() -> None:
    def body(comm: plait.Communicator) -> None:
        b = Bucketer(comm, [np.ones(3, np.float32)])
        b.ready(0)
        with pytest.raises(ValueError, match="To accumulate gradients over several backward"):
            b.ready(0)
        b.wait()

    run_ranks(1, body)


# -- a bucket that fails (Note [what a failed step leaves] in plait.bucketing) ----------------
def test_a_failed_bucket_is_said_to_leave_which_gradients_averaged_and_which_own() -> None:
    """Gradient 0 is float32 on rank 0 and float64 on rank 1: its bucket's allreduce, the
    last to start (so every ready() is taken first), fails. The buckets before it were
    written back, and the error said only that "the output buffer's contents are undefined"
    (the bucket's own buffer)."""

    def body(comm: plait.Communicator) -> tuple[list[np.ndarray], str]:
        mine = [np.full(10, 10.0 * comm.rank + i, np.float32) for i in range(4)]
        if comm.rank == 1:
            mine[0] = mine[0].astype(np.float64)
        grads = [g.copy() for g in mine]
        b = Bucketer(comm, grads, bucket_bytes=40)  # one gradient a bucket: [3], [2], [1], [0]
        for i in (3, 2, 1, 0):
            b.ready(i)
        with pytest.raises(plait.CommError) as info:
            b.wait()
        return [g - m for g, m in zip(grads, mine, strict=True)], str(info.value)

    for rank, (changed, said) in enumerate(run_ranks(2, body)):
        assert not changed[0].any()  # this rank's own
        for c in changed[1:]:  # the average of i and 10 + i
            np.testing.assert_array_equal(c, np.full(10, 5.0 if rank == 0 else -5.0))
        assert "the allreduce of bucket 3 (bucket_members()[3]) failed" in said
        assert "gradients [1, 2, 3] hold this step's results" in said
        assert "gradients [0] hold this rank's own values" in said
        assert "no gradient is undefined" in said


def test_a_failed_first_bucket_is_said_to_write_nothing() -> None:
    def body(comm: plait.Communicator) -> tuple[bool, str]:
        mine = np.full(10, comm.rank + 1.0, np.float32 if comm.rank == 0 else np.float64)
        g = mine.copy()
        b = Bucketer(comm, [g])
        b.ready(0)
        with pytest.raises(plait.CommError) as info:
            b.wait()
        return bool((g == mine).all()), str(info.value)

    for unchanged, said in run_ranks(2, body):
        assert unchanged
        assert "no gradient was written: each holds this rank's own values" in said


def test_a_finish_that_fails_says_which_param_grads_hold_averages() -> None:
    """Rank 1's first weight is float64: its bucket, the last to start, fails after the
    others succeeded and were written into ``.grad``."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(6, 16, bias=False), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    _, inputs = model_and_inputs(2, 1)

    def body(comm: plait.Communicator) -> tuple[list[np.ndarray], list[np.ndarray], str]:
        model = copy.deepcopy(base)
        if comm.rank == 1:
            model[0].double()
        finish = attach(model, comm, bucket_bytes=64)  # buckets [2], [1], [0]
        first = model[0](inputs[comm.rank][0].to(model[0].weight.dtype)).float()
        model[2](model[1](first)).square().sum().backward()
        before = [p.grad.double().numpy().copy() for p in model.parameters()]
        with pytest.raises(plait.CommError) as info:
            finish()
        return before, [p.grad.double().numpy() for p in model.parameters()], str(info.value)

    out = run_ranks(2, body)
    for before, after, said in out:
        np.testing.assert_array_equal(after[0], before[0])  # the first weight: this rank's own
        for i in (1, 2):  # the last layer's: the average
            np.testing.assert_allclose(after[i], (out[0][0][i] + out[1][0][i]) / 2, rtol=1e-6)
        assert "gradients [1, 2] hold this step's results" in said
        assert "gradients [0] hold this rank's own values" in said
