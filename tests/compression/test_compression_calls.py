"""Compressed calls: the compressor's state in call order, ranks whose calls differ, the checks
of ``compression=``, ``async_op`` and the compressors' arguments, PowerSGD's fallback for AVG,
and int8 at the edges of the float range."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import plait
from plait.bucketing import Bucketer
from plait.compression import FP16, Int8, PowerSGD, TopK
from plait.compression.int8 import dequantize, quantize
from plait.errors import MismatchError
from plait.testing import RankFailure, run_ranks

ROOT = Path(__file__).resolve().parents[2]


# -- state in call order (Note [compressed calls in order] in plait._compressed) ---------------
def _topk_mixed(comm: plait.Communicator) -> float:
    """Error feedback's promise with a blocking call made while an async one is pending:
    once the residuals are flushed, the outputs add up to the inputs."""
    c = TopK(0.2)
    out_sum = np.zeros(20)
    in_sum = np.zeros(20)
    for t in range(10):
        a = np.random.default_rng([comm.rank, t, 0]).standard_normal(20)
        b = np.random.default_rng([comm.rank, t, 1]).standard_normal(20)
        w = comm.allreduce(a, plait.SUM, compression=c.with_key("g"), async_op=True)
        rb = comm.allreduce(b, plait.SUM, compression=c.with_key("g"))
        out_sum += w.wait() + rb
        in_sum += a + b
    for _ in range(5):  # k = 4 of 20: five steps of zeros send every residual entry
        out_sum += comm.allreduce(np.zeros(20), plait.SUM, compression=c.with_key("g"))
    return float(np.max(np.abs(out_sum - comm.allreduce(in_sum))))


def _powersgd_mixed(comm: plait.Communicator) -> list[np.ndarray]:
    """PowerSGD's kept Q after each step of an async call and a blocking one on one key."""
    c = PowerSGD(1)
    qs = []
    for t in range(20):
        a = np.random.default_rng([comm.rank, t, 0]).standard_normal((32, 16))
        b = np.random.default_rng([comm.rank, t, 1]).standard_normal((32, 16))
        w = comm.allreduce(a, plait.SUM, compression=c.with_key("w"), async_op=True)
        comm.allreduce(b, plait.SUM, compression=c.with_key("w"))
        w.wait()
        qs.append(c._state(comm, "w", a).q.copy())
    return qs


def test_a_blocking_call_behind_a_pending_async_one_keeps_error_feedback_exact() -> None:
    for err in run_ranks(2, _topk_mixed):
        assert err < 1e-9  # was 5.8: the blocking call used the residual before the async one


def test_a_blocking_call_behind_a_pending_async_one_keeps_q_identical() -> None:
    mine, theirs = run_ranks(2, _powersgd_mixed)
    for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        assert a.tobytes() == b.tobytes(), f"the ranks' Q differ after step {step}"


def test_a_blocking_call_behind_a_pending_async_one_raises_its_error() -> None:
    def body(comm: plait.Communicator) -> None:
        c = TopK(1.0).with_key("k")
        w = comm.allreduce(np.ones(4), compression=c, async_op=True)
        x = np.ones(100 - comm.rank)  # the ranks' counts differ
        with pytest.raises(MismatchError, match="the ranks' calls do not match"):
            comm.allreduce(x, compression=TopK(0.01))
        np.testing.assert_array_equal(w.wait(), np.full(4, 2.0))
        # in order again: a blocking call with nothing pending runs at once
        np.testing.assert_array_equal(comm.allreduce(np.ones(4), compression=c), np.full(4, 2.0))

    run_ranks(2, body)


_ORDER_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import plait
    from plait.compression import PowerSGD, TopK

    with plait.init(timeout=60) as comm:
        c = TopK(0.2)
        out_sum, in_sum = np.zeros(20), np.zeros(20)
        for t in range(10):
            a = np.random.default_rng([comm.rank, t, 0]).standard_normal(20)
            b = np.random.default_rng([comm.rank, t, 1]).standard_normal(20)
            w = comm.allreduce(a, plait.SUM, compression=c.with_key("g"), async_op=True)
            rb = comm.allreduce(b, plait.SUM, compression=c.with_key("g"))
            out_sum += w.wait() + rb
            in_sum += a + b
        for _ in range(5):
            out_sum += comm.allreduce(np.zeros(20), plait.SUM, compression=c.with_key("g"))
        err = np.max(np.abs(out_sum - comm.allreduce(in_sum)))
        p = PowerSGD(1)
        differ = 0
        for t in range(20):
            a = np.random.default_rng([comm.rank, t, 0]).standard_normal((32, 16))
            b = np.random.default_rng([comm.rank, t, 1]).standard_normal((32, 16))
            w = comm.allreduce(a, plait.SUM, compression=p.with_key("w"), async_op=True)
            comm.allreduce(b, plait.SUM, compression=p.with_key("w"))
            w.wait()
            qs = comm.allgather(p._state(comm, "w", a).q)
            differ += int(not all(np.array_equal(qs[0], q) for q in qs))
        print(f"rank {comm.rank}: {err:.3g} {differ}", flush=True)
    """
)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_state_stays_in_call_order_between_processes(tmp_path: Path) -> None:
    """Between real processes: the blocking call ran on its own thread while the worker was
    still to run the async one (error feedback off by 2.8, Q different after 12 of 30 steps)."""
    script = tmp_path / "order.py"
    script.write_text(_ORDER_SCRIPT)
    res = subprocess.run(
        [sys.executable, "-m", "plait", "run", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, res.stdout
    for line in lines:
        err, differ = line.split()[2:]
        assert float(err) < 1e-9, line
        assert differ == "0", line


# -- ranks whose calls differ (Note [call headers] in plait.compression.base) -------------------
def _each_rank_raises(body: Any, size: int = 2) -> dict[int, BaseException]:
    with pytest.raises(RankFailure) as info:
        run_ranks(size, body)
    errors = info.value.errors
    assert sorted(errors) == list(range(size)), errors
    return errors


MAKERS = {"int8": Int8, "topk-1%": lambda: TopK(0.01), "topk-all": lambda: TopK(1.0)}
CALLS = {
    # 100 and 99 elements: int8's shards and top-k's k at 1 % are the same for both
    "count": lambda r: (np.ones(100 - r, np.float32), plait.SUM),
    "dtype": lambda r: (np.ones(100, np.float32 if r else np.float16), plait.SUM),
    "op": lambda r: (np.ones(100, np.float32), plait.AVG if r else plait.SUM),
    "empty": lambda r: (np.ones(4 * r, np.float32), plait.SUM),
}


@pytest.mark.parametrize("method", MAKERS)
@pytest.mark.parametrize("what", CALLS)
def test_ranks_that_pass_different_calls_all_raise_mismatch(method: str, what: str) -> None:
    """int8 returned arrays of different shapes, top-k one array and an IndexError; where
    the sizes of their collectives differ, those raise MismatchError themselves."""

    def body(comm: plait.Communicator) -> None:
        x, op = CALLS[what](comm.rank)
        comm.allreduce(x, op, compression=MAKERS[method]())

    for rank, err in _each_rank_raises(body).items():
        assert isinstance(err, MismatchError), (rank, err)
        if what == "count" and method != "topk-all":  # the headers tell it
            assert "rank 0 passed 100 float32 elements with SUM; rank 1 passed 99" in str(err)


def test_a_mismatched_top_k_call_leaves_the_residual_as_it_was() -> None:
    """Top-k kept the residual of a call that then failed its header check: the entries it
    had picked to send were taken out of the residual though no rank added them."""

    def body(comm: plait.Communicator) -> bool:
        t = TopK(0.1)
        c = t.with_key("g")
        x = np.random.default_rng(comm.rank).standard_normal(100)
        comm.allreduce(x, plait.SUM, compression=c)
        before = t._state(comm, "g", x).copy()
        with pytest.raises(MismatchError):
            comm.allreduce(2 * x, plait.AVG if comm.rank else plait.SUM, compression=c)
        return bool(np.array_equal(t._state(comm, "g", x), before))

    assert run_ranks(2, body) == [True, True]


def test_the_mismatch_names_the_ranks_that_passed_each_call() -> None:
    def body(comm: plait.Communicator) -> None:
        n = 10 if comm.rank == 1 else 12
        comm.allreduce(np.ones(n, np.float64), plait.AVG, compression=Int8())

    for rank, err in _each_rank_raises(body, 3).items():
        assert str(err) == (
            f"rank {rank}: allreduce (int8 compression): the ranks' calls do not match: "
            "ranks 0, 2 passed 12 float64 elements with AVG; rank 1 passed 10 float64 elements "
            "with AVG"
        )


def test_matching_calls_of_zero_elements_still_work() -> None:
    def body(comm: plait.Communicator) -> list[np.ndarray]:
        x = np.ones((0, 3), np.float32)
        return [comm.allreduce(x, compression=c) for c in (Int8(), TopK(0.5), TopK(0.5))]

    for res in run_ranks(2, body):
        for r in res:
            assert r.shape == (0, 3)
            assert r.dtype == np.float32


# -- the checks of compression=, async_op and the compressors' arguments ------------------------
def test_async_op_must_be_a_bool() -> None:
    def body(comm: plait.Communicator) -> None:
        x = np.ones(3, np.float32)
        for bad in ("False", 1, None, 0.0):
            with pytest.raises(TypeError, match="async_op must be True or False"):
                comm.allreduce(x, compression=FP16(), async_op=bad)  # type: ignore[call-overload]
        w = comm.allreduce(x, compression=FP16(), async_op=np.bool_(True))
        np.testing.assert_array_equal(w.wait(), np.full(3, 2.0))

    run_ranks(2, body)


def test_a_compressor_class_is_refused_with_a_hint() -> None:
    def body(comm: plait.Communicator) -> None:
        x = np.ones(4, np.float32)
        with pytest.raises(TypeError, match=r"not the class FP16; make one: compression=FP16\(\)"):
            comm.allreduce(x, compression=FP16)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match=r"plait\.compression compressor"):
            comm.allreduce(x, compression=int)  # type: ignore[call-overload]
        np.testing.assert_array_equal(comm.allreduce(x, compression=FP16()), np.full(4, 2.0))

    run_ranks(2, body)


@pytest.mark.parametrize(
    ("compression", "match"),
    [
        ("fp16", r"^Bucketer: compression must be a plait\.compression compressor"),
        (FP16, r"^Bucketer: .*not the class FP16; make one: compression=FP16\(\)"),
        (PowerSGD, r"^Bucketer: .*not the class PowerSGD"),
    ],
)
def test_the_bucketer_refuses_what_is_not_a_compressor_when_made(
    compression: Any, match: str
) -> None:
    def body(comm: plait.Communicator) -> None:
        with pytest.raises(TypeError, match=match):
            Bucketer(comm, [np.ones(8, np.float32)], compression=compression)

    run_ranks(1, body)


def test_numpy_numbers_are_taken_as_arguments() -> None:
    i8 = Int8(block_size=np.int64(64))
    assert i8.block_size == 64
    assert type(i8.block_size) is int
    psgd = PowerSGD(np.int32(2))
    assert psgd.rank == 2
    assert type(psgd.rank) is int
    for ratio in (np.float32(0.25), np.float64(0.25)):
        assert TopK(ratio).ratio == 0.25
        assert type(TopK(ratio).ratio) is float
    assert TopK(np.int64(1)).ratio == 1.0
    for bad, match in (
        (lambda: Int8(np.bool_(True)), "block_size"),
        (lambda: Int8(np.int64(0)), "block_size"),
        (lambda: PowerSGD(True), "rank"),
        (lambda: PowerSGD(np.int64(-1)), "rank"),
        (lambda: TopK(True), "ratio"),
        (lambda: TopK(np.float32(1.5)), "ratio"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()

    def body(comm: plait.Communicator) -> np.ndarray:
        x = np.ones((64, 32), np.float32)
        res: np.ndarray = comm.allreduce(x, compression=Int8(np.int64(16)))
        return res

    for res in run_ranks(2, body):
        np.testing.assert_array_equal(res, np.full((64, 32), 2.0))


# -- PowerSGD's fallback averages in the working precision -------------------------------------
@pytest.mark.parametrize("shape", [(4,), (4, 4)])
def test_powersgd_fallback_averages_float16_without_overflow(shape: tuple[int, ...]) -> None:
    c = PowerSGD(1)
    x = np.full(shape, 60000, np.float16)  # a sum over 2 ranks overflows float16, the mean not
    assert c.matrix_shape(shape) is None  # falls back
    assert c.collectives(x, None) == 1  # type: ignore[arg-type]

    def body(comm: plait.Communicator) -> tuple[np.ndarray, np.ndarray]:
        mean = comm.allreduce(x, plait.AVG, compression=c)
        total = comm.allreduce(x, plait.SUM, compression=c)
        return mean, total

    for mean, total in run_ranks(2, body):
        assert mean.dtype == np.float16
        assert mean.shape == shape
        np.testing.assert_array_equal(mean, x)  # was inf
        assert np.isinf(total).all()  # a SUM float16 cannot hold stays the plain allreduce's


def test_powersgd_fallback_average_matches_the_other_compressors() -> None:
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(50).astype(np.float32) for _ in range(3)]

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        return [
            comm.allreduce(xs[comm.rank], plait.AVG, compression=c) for c in (PowerSGD(1), None)
        ]

    for psgd, plain in run_ranks(3, body):
        np.testing.assert_allclose(psgd, plain, rtol=1e-6)


# -- int8 at the edges of the float range (Note [the edges of the float range]) -----------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_int8_keeps_the_largest_finite_values_finite(dtype: type) -> None:
    top = np.finfo(dtype).max
    v = np.array([top, 1.0, -top, top / 3], dtype)
    codes, scales = quantize(v, 4)
    back = dequantize(codes, scales, 4)
    assert np.isfinite(back).all(), back
    assert np.all(np.abs(back - v) <= scales[0] / 2)

    def body(comm: plait.Communicator) -> np.ndarray:
        res: np.ndarray = comm.allreduce(np.array([top, 1.0], dtype), plait.AVG, compression=Int8())
        return res

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warning leaked
        (res,) = run_ranks(1, body)
    assert res[0] == top  # was NaN
    assert np.isfinite(res).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_int8_keeps_subnormal_blocks(dtype: type) -> None:
    tiny = np.finfo(dtype).smallest_subnormal
    v = np.array([tiny, -tiny, 2 * tiny, 0], dtype)
    codes, scales = quantize(v, 4)
    assert scales[0] > 0  # max|v| / 127 underflowed to 0
    np.testing.assert_array_equal(dequantize(codes, scales, 4), v)

    def body(comm: plait.Communicator) -> np.ndarray:
        res: np.ndarray = comm.allreduce(v, plait.AVG, compression=Int8())
        return res

    (res,) = run_ranks(1, body)
    np.testing.assert_array_equal(res, v)  # was all zeros


def test_int8_non_finite_blocks_still_come_back_as_nan() -> None:
    top = np.finfo(np.float32).max
    v = np.array([[np.inf, 1.0, top, 2.0], [np.nan, top, 1.0, 0.0], [top, 1.0, 2.0, 3.0]], "f4")
    codes, scales = quantize(v, 4)
    back = dequantize(codes, scales, 4)
    assert np.isnan(back[:2]).all()
    assert np.isfinite(back[2]).all()


@pytest.mark.torch
def test_the_ddp_hook_refuses_what_is_not_a_compressor_when_made() -> None:
    pytest.importorskip("torch")
    from plait.torch.hooks import compression_hook

    with pytest.raises(TypeError, match=r"^compression_hook: .*not the class Int8; make one"):
        compression_hook(Int8)
    with pytest.raises(TypeError, match=r"^compression_hook: compression must be a plait"):
        compression_hook("int8")
