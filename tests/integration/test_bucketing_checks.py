"""Bucketer: PowerSGD per gradient matrix, and what is refused when the Bucketer is built.

See Note [PowerSGD in buckets] and Note [refused when built] in plait.bucketing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import plait
from plait.bucketing import Bucketer, attach
from plait.compression import FP16, PowerSGD
from plait.testing import run_ranks

# A matrix PowerSGD compresses, a vector, a matrix too small to gain, a 3-D one (8 x 60).
SHAPES = [(256, 256), (64,), (4, 2), (8, 3, 20)]


def grads_of(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def bucketed(comm: plait.Communicator, compression: Any, steps: int) -> list[list[np.ndarray]]:
    """Each step's averages through one Bucketer."""
    grads = [np.zeros(s, np.float32) for s in SHAPES]
    b = Bucketer(comm, grads, compression=compression, bucket_bytes=1 << 20)
    seen = []
    for step in range(steps):
        for i, g in enumerate(grads_of(comm.rank, step)):
            grads[i][...] = g
        for i in reversed(range(len(grads))):
            b.ready(i)
        b.wait()
        seen.append([g.copy() for g in grads])
    return seen


def one_by_one(comm: plait.Communicator, compressors: list[Any], steps: int) -> list[Any]:
    """The same steps with one compressed allreduce per gradient; each array kept, so that
    its identity keys PowerSGD's state across steps as the Bucketer's buffers do."""
    kept = [np.zeros(s, np.float32) for s in SHAPES]
    seen = []
    for step in range(steps):
        for k, g in zip(kept, grads_of(comm.rank, step), strict=True):
            k[...] = g
        seen.append(
            [
                comm.allreduce(k, plait.AVG, compression=c)
                for k, c in zip(kept, compressors, strict=True)
            ]
        )
    return seen


def test_powersgd_compresses_each_gradient_as_its_own_matrix() -> None:
    """A bucket is a flat 1-D buffer, which PowerSGD sends whole: the Bucketer sent the full
    gradients and returned their exact average (the bytes: test_bucketing_processes.py)."""
    steps = 3

    def body(comm: plait.Communicator) -> tuple[list[Any], list[Any]]:
        direct = PowerSGD(1)
        return bucketed(comm, PowerSGD(1), steps), one_by_one(comm, [direct] * 4, steps)

    out = run_ranks(2, body)
    for got, want in out:
        for step in range(steps):
            for g, w in zip(got[step], want[step], strict=True):
                assert g.tobytes() == w.tobytes()  # as the per-gradient calls, error feedback too
    exact = (grads_of(0, 0)[0] + grads_of(1, 0)[0]) / 2
    assert np.abs(out[0][0][0][0] - exact).max() > 0.1  # rank 1 of a random matrix: not exact
    for step in range(steps):
        for a, b in zip(out[0][0][step], out[1][0][step], strict=True):
            assert a.tobytes() == b.tobytes()  # the same bits on every rank


def test_a_keyed_powersgd_keeps_each_gradient_under_its_own_key() -> None:
    """c.with_key(k) keys each gradient's state (k, index): one key for every gradient would
    hold matrices of two shapes and be refused."""

    def body(comm: plait.Communicator) -> tuple[list[Any], list[Any]]:
        c = PowerSGD(1).with_key("model")
        direct = PowerSGD(1)
        keys = [direct.with_key(("model", i)) for i in range(len(SHAPES))]
        return bucketed(comm, c, 2), one_by_one(comm, keys, 2)

    for got, want in run_ranks(2, body):
        for step in range(2):
            for g, w in zip(got[step], want[step], strict=True):
                assert g.tobytes() == w.tobytes()


def test_a_keyed_compressor_keeps_each_bucket_under_its_own_key() -> None:
    """TopK(...).with_key("m") shared one key among buckets of 10 and 20 elements: the second
    bucket's allreduce was refused mid-step, after the first had started."""
    from plait.compression import TopK

    def body(comm: plait.Communicator) -> list[list[float]]:
        grads = [np.full(10, comm.rank + 1.0, np.float32), np.full(20, 1.0, np.float32)]
        b = Bucketer(comm, grads, bucket_bytes=1, compression=TopK(1.0).with_key("m"))
        assert b.num_buckets == 2
        for _ in range(2):
            b.ready(1)
            b.ready(0)
            b.wait()
        return [sorted(set(g.tolist())) for g in grads]

    assert run_ranks(2, body) == [[[1.5], [1.0]], [[1.5], [1.0]]]


def test_attach_compresses_each_weight_with_powersgd() -> None:
    torch = pytest.importorskip("torch")
    import copy

    torch.manual_seed(0)
    base = torch.nn.Linear(64, 64)
    inputs = [
        torch.from_numpy(np.random.default_rng(r).standard_normal((16, 64))).float()
        for r in range(2)
    ]

    def body(comm: plait.Communicator) -> tuple[np.ndarray, np.ndarray]:
        model = copy.deepcopy(base)
        finish = attach(model, comm, compression=PowerSGD(1))
        model(inputs[comm.rank]).square().sum().backward()
        finish()
        alone = copy.deepcopy(base)
        alone(inputs[comm.rank]).square().sum().backward()
        w = alone.weight.grad.numpy().copy()
        want = comm.allreduce(w, plait.AVG, compression=PowerSGD(1))
        return model.weight.grad.numpy().copy(), want

    for got, want in run_ranks(2, body):
        assert got.tobytes() == want.tobytes()


def test_compression_takes_big_endian_floats_as_the_communicator_does() -> None:
    """Bucketer(compression=FP16()) refused '>f4', which comm.allreduce(compression=FP16())
    takes: the check compared dtypes against the native ones."""

    def body(comm: plait.Communicator) -> list[float]:
        g = np.full(3, comm.rank + 1.0, ">f4")
        b = Bucketer(comm, [g], compression=FP16())
        b.ready(0)
        b.wait()
        return g.tolist()

    assert run_ranks(2, body) == [[1.5] * 3, [1.5] * 3]


def test_an_op_some_gradient_cannot_take_is_refused_when_built() -> None:
    """AVG (the default) and an int64 gradient: the Bucketer was made, the float gradient's
    bucket started at ready(0), and ready(1) raised mid-step."""

    def body(comm: plait.Communicator) -> None:
        grads = [np.ones(4, np.float32), np.ones(4, np.int64)]
        with pytest.raises(TypeError, match=r"gradient 1: op AVG is not defined for int64"):
            Bucketer(comm, grads, bucket_bytes=1)
        with pytest.raises(TypeError, match=r"gradient 0: op BAND is not defined for float32"):
            Bucketer(comm, grads, op=plait.BAND)
        with pytest.raises(TypeError, match=r"op must be a plait\.Op such as plait\.AVG"):
            Bucketer(comm, grads, op="sum")
        b = Bucketer(comm, grads, bucket_bytes=1, op=plait.SUM)
        b.ready(0)
        b.ready(1)
        b.wait()
        assert grads[1].tolist() == [2, 2, 2, 2]

    run_ranks(2, body)


@pytest.mark.parametrize("dtype", [object, "U4", "datetime64[s]", "V2"])
def test_a_dtype_plait_cannot_move_is_refused_when_built(dtype: Any) -> None:
    """A (shape, dtype) pair of such a dtype was accepted and refused at every ready()."""
    with pytest.raises(TypeError, match=r"^Bucketer: gradient 1: dtype .* is not supported"):
        Bucketer(None, [((3,), np.float32), ((3,), dtype)])


@pytest.mark.parametrize(
    ("bucket_bytes", "error", "match"),
    [
        (float("nan"), TypeError, "bucket_bytes must be an int"),
        (True, TypeError, "bucket_bytes must be an int"),
        (0.5, TypeError, "bucket_bytes must be an int"),
        ("1024", TypeError, "bucket_bytes must be an int"),
        (0, ValueError, "bucket_bytes must be positive; got 0"),
        (-8, ValueError, "bucket_bytes must be positive; got -8"),
    ],
)
def test_bucket_bytes_is_a_positive_int(bucket_bytes: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Bucketer(None, [np.ones(3)], bucket_bytes=bucket_bytes)


def test_layout_and_order_are_made_of_ints() -> None:
    with pytest.raises(TypeError, match=r"shape must be a tuple of sizes .* got \(2\.0,\)"):
        Bucketer(None, [((2.0,), np.float32)])
    with pytest.raises(TypeError, match=r"shape must be a tuple of sizes .* got 3"):
        Bucketer(None, [(3, np.float32)])
    with pytest.raises(TypeError, match=r"shape must be a tuple of sizes .* got \(-1,\)"):
        Bucketer(None, [((-1,), np.float32)])
    with pytest.raises(TypeError, match="expected an array or a \\(shape, dtype\\) pair"):
        Bucketer(None, [((3,), np.float32, "extra")])
    with pytest.raises(TypeError, match=r"order must list gradient indexes \(ints\)"):
        Bucketer(None, [((3,), np.float64)] * 2, order=[1.0, 0])
    with pytest.raises(TypeError, match=r"order must list gradient indexes \(ints\)"):
        Bucketer(None, [((3,), np.float64)] * 2, order=[True, 0])
    b = Bucketer(None, [((3,), np.float64)] * 2, order=[np.int64(1), np.int64(0)], bucket_bytes=8)
    assert b.bucket_members() == [[1], [0]]


def test_ready_takes_an_int_index() -> None:
    """ready(True) was gradient 1; ready(1.0) raised "list indices must be integers"."""

    def body(comm: plait.Communicator) -> list[float]:
        grads = [np.full(2, comm.rank + 1.0), np.full(2, 10.0 * (comm.rank + 1))]
        b = Bucketer(comm, grads)
        for bad in (True, 1.0, "1", None):
            with pytest.raises(TypeError, match=r"Bucketer\.ready: index must be an int"):
                b.ready(bad)  # type: ignore[arg-type]
        b.ready(np.int64(1))  # nothing was started: the step goes on
        b.ready(0)
        b.wait()
        return [float(grads[0][0]), float(grads[1][0])]

    assert run_ranks(2, body) == [[1.5, 15.0], [1.5, 15.0]]
