"""Gradient bucketing: fused, overlapped allreduce of many gradients, checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest

import plait
from plait.bucketing import Bucketer, attach
from plait.testing import run_ranks

SHAPES = [(7, 5), (5,), (64, 33), (33,), (3,), (1000,), (2, 2, 2)]


def grads_of(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("bucket_bytes", [1, 300, 4096, 1 << 20])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_bucketed_average_equals_numpy(size: int, bucket_bytes: int) -> None:
    steps = 3

    def body(comm: plait.Communicator) -> list[list[np.ndarray]]:
        grads = [np.empty(s, np.float32) for s in SHAPES]
        b = Bucketer(comm, grads, bucket_bytes=bucket_bytes)
        results = []
        for step in range(steps):
            mine = grads_of(comm.rank, step)
            for i in reversed(range(len(SHAPES))):
                grads[i][...] = mine[i]
                b.ready(i)
            b.wait()
            results.append([g.copy() for g in grads])
        return results

    out = run_ranks(size, body)
    for step in range(steps):
        per_rank = [grads_of(r, step) for r in range(size)]
        for i in range(len(SHAPES)):
            want = sum(per_rank[r][i] for r in range(size)) / size
            np.testing.assert_allclose(out[0][step][i], want, rtol=1e-6, atol=1e-7)
            for r in range(1, size):  # bit-identical on every rank
                assert out[r][step][i].tobytes() == out[0][step][i].tobytes()


def test_buckets_follow_backward_order_and_size() -> None:
    def body(comm: plait.Communicator) -> list[list[int]]:
        layout = [((100,), np.float32)] * 5  # 400 bytes each
        return Bucketer(comm, layout, bucket_bytes=800).bucket_members()

    assert run_ranks(1, body)[0] == [[4, 3], [2, 1], [0]]


def test_gradients_ready_out_of_order_start_buckets_in_order() -> None:
    """Rank 1 finishes its gradients in another order: buckets still start alike."""

    def body(comm: plait.Communicator) -> np.ndarray:
        grads = [np.full(10, float(comm.rank + i), np.float32) for i in range(4)]
        b = Bucketer(comm, grads, bucket_bytes=40, op=plait.SUM)
        order = [3, 2, 1, 0] if comm.rank == 0 else [0, 2, 1, 3]
        for i in order:
            b.ready(i)
        b.wait()
        return np.stack(grads)

    a, c = run_ranks(2, body)
    want = np.stack([np.full(10, 2.0 * i + 1, np.float32) for i in range(4)])
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(c, want)


def test_dtypes_are_never_mixed_in_a_bucket() -> None:
    def body(comm: plait.Communicator) -> list[list[int]]:
        grads = [np.ones(4, np.float32), np.ones(4, np.float64), np.ones(4, np.float32)]
        b = Bucketer(comm, grads)
        for i in (2, 1, 0):
            b.ready(i)
        b.wait()
        assert all(np.all(g == 1) for g in grads)
        return b.bucket_members()

    assert run_ranks(2, body)[0] == [[2], [1], [0]]


def test_misuse_is_refused() -> None:
    def body(comm: plait.Communicator) -> None:
        grads = [np.ones(3, np.float32), np.ones(2, np.float32)]
        b = Bucketer(comm, grads)
        b.ready(1)
        with pytest.raises(ValueError, match="already marked"):
            b.ready(1)
        with pytest.raises(ValueError, match="out of range"):
            b.ready(5)
        with pytest.raises(ValueError, match=r"gradients \[0\] were not marked"):
            b.wait()
        shaped = Bucketer(comm, [((3,), np.float32)])
        with pytest.raises(ValueError, match="pass its array"):
            shaped.ready(0)
        with pytest.raises(ValueError, match="expected"):
            shaped.ready(0, np.ones(4, np.float32))
        with pytest.raises(ValueError, match="at least one"):
            Bucketer(comm, [])
        with pytest.raises(ValueError, match="order"):
            Bucketer(comm, grads, order=[0, 0])

    run_ranks(1, body)


def test_torch_module_gradients_are_averaged_during_backward() -> None:
    torch = pytest.importorskip("torch")
    import copy

    torch.manual_seed(0)  # one model, copied per rank (torch's RNG is shared by threads)
    base = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    inputs = [
        torch.from_numpy(np.random.default_rng(r).standard_normal((8, 6))).float() for r in range(3)
    ]

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        model = copy.deepcopy(base)
        finish = attach(model, comm, bucket_bytes=256)
        for _ in range(2):
            model.zero_grad()
            model(inputs[comm.rank]).square().sum().backward()
            finish()
        return [p.grad.numpy().copy() for p in model.parameters()]

    grads = []
    for r in range(3):
        model = copy.deepcopy(base)
        model(inputs[r]).square().sum().backward()
        grads.append([p.grad.numpy().copy() for p in model.parameters()])
    want = [sum(g[i] for g in grads) / 3 for i in range(len(grads[0]))]

    out = run_ranks(3, body)
    for got, w in zip(out[0], want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    for r in (1, 2):
        for a, b in zip(out[0], out[r], strict=True):
            assert a.tobytes() == b.tobytes()
