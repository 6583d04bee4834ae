"""Compressors at the edges: byte order, float64's range, non-finite steps, claimed keys."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_compression_methods import ALL

import plait
from plait.compression import Compressor, Int8, PowerSGD, TopK
from plait.compression.cast import to_bf16_bits
from plait.compression.int8 import dequantize, quantize
from plait.testing import run_ranks

#: Every compressor, and top-k sending every entry (exact, so byte-order mistakes show).
METHODS: dict[str, Callable[[], Compressor]] = {**ALL, "topk-all": lambda: TopK(1.0)}


# -- byte order (Note [byte order]) --------------------------------------------------------------
@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("dtype", ["f4", "f8", "f2"])
def test_ranks_may_pass_the_same_values_in_different_byte_orders(name: str, dtype: str) -> None:
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((40, 30)).astype(dtype) for _ in range(3)]

    def body(comm: plait.Communicator, swapped: bool) -> list[np.ndarray]:
        c = METHODS[name]()
        x = xs[comm.rank]
        if swapped and comm.rank % 2 == 1:
            x = x.astype(x.dtype.newbyteorder())  # same values, the other byte order
        buf = np.empty_like(x)  # one buffer across steps: its identity keys the state
        got = []
        for _ in range(2):
            buf[...] = x
            res = comm.allreduce(buf, plait.AVG, compression=c)
            assert res.dtype == x.dtype
            got.append(res.astype(np.float64))
        return got

    want = run_ranks(3, lambda comm: body(comm, False))
    got = run_ranks(3, lambda comm: body(comm, True))
    for rank in range(3):
        for a, b in zip(got[rank], want[0], strict=True):
            assert a.tobytes() == b.tobytes(), f"rank {rank} differs from the native run"


# -- int8 computes float64 data in float64 --------------------------------------------------------
@pytest.mark.parametrize("scale", [1e39, 1e-50, 1.0])
def test_int8_keeps_float64_range(scale: float) -> None:
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal(100) * scale for _ in range(3)]

    def body(comm: plait.Communicator) -> np.ndarray:
        res: np.ndarray = comm.allreduce(xs[comm.rank], compression=Int8(block_size=16))
        return res

    results = run_ranks(3, body)
    for res in results:
        assert res.tobytes() == results[0].tobytes()
    exact = np.sum(xs, axis=0)
    assert np.isfinite(results[0]).all()
    # two quantizations, each at most half a step of its block: well within 3 steps of the largest
    bound = 3 * 3 * np.max(np.abs(xs)) / 127
    assert np.max(np.abs(results[0] - exact)) <= bound
    assert np.max(np.abs(results[0])) > scale / 10  # not flushed to zero


def test_int8_quantize_keeps_float64_scales() -> None:
    v = np.array([1e39, -3e39, 1e-300, 0.0])
    codes, scales = quantize(v, 4)
    assert scales.dtype == np.float64
    np.testing.assert_allclose(dequantize(codes, scales, 4), v, rtol=0, atol=3e39 / 127 / 2)
    assert quantize(np.ones(4, np.float32), 4)[1].dtype == np.float32


# -- AVG divides before the cast back to float16 ---------------------------------------------------
@pytest.mark.parametrize("make", [lambda: Int8(), lambda: TopK(1.0)], ids=["int8", "topk"])
def test_float16_mean_that_float16_holds_does_not_overflow(make: Callable[[], Any]) -> None:
    def body(comm: plait.Communicator) -> np.ndarray:
        x = np.full(4, 40000.0, np.float16)  # the sum overflows float16; the mean does not
        res: np.ndarray = comm.allreduce(x, plait.AVG, compression=make())
        return res

    for res in run_ranks(2, body):
        assert res.dtype == np.float16
        np.testing.assert_array_equal(res, np.full(4, 40000.0, np.float16))


# -- bf16 rounds float64 once ----------------------------------------------------------------------
def test_bf16_rounds_float64_once() -> None:
    # just above and just below a bfloat16 tie: through float32, both become the tie
    x = np.array([1 + 2**-8 + 2**-40, 1 + 3 * 2**-8 - 2**-40])
    assert [int(b) for b in to_bf16_bits(x)] == [0x3F81, 0x3F81]
    assert [int(b) for b in to_bf16_bits(-x)] == [0xBF81, 0xBF81]
    big = np.array([3.4e38, 1e39, -1e300, np.inf, 1e-300, -1e-300, 0.0])
    assert [int(b) for b in to_bf16_bits(big)] == [0x7F80, 0x7F80, 0xFF80, 0x7F80, 0, 0x8000, 0]


def test_bf16_from_float64_matches_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(10)
    values = rng.integers(0, 2**64, 50_000, np.uint64).view(np.float64)
    spread = rng.standard_normal(50_000) * np.exp2(rng.integers(-140, 130, 50_000))
    # bfloat16 ties nudged by less than half a float32 step, where rounding through float32 errs
    ties = (rng.integers(0, 0x7F7F, 20_000, np.uint32) << 16 | 0x8000).view(np.float32)
    nudge = np.exp2(-30.0 - rng.integers(0, 20, ties.size)) * rng.choice([-1, 1], ties.size)
    near = ties.astype(np.float64) * (1 + nudge)
    values = np.concatenate([values, spread, near, -near])
    values = values[~np.isnan(values)]
    with np.errstate(over="ignore"):
        want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(to_bf16_bits(values), want)
    np.testing.assert_array_equal(to_bf16_bits(values.astype(">f8")), want)


# -- a non-finite step does not poison the state ---------------------------------------------------
@pytest.mark.parametrize("make", [lambda: TopK(0.5), lambda: PowerSGD(1)], ids=["topk", "powersgd"])
def test_a_non_finite_step_leaves_the_state_finite(make: Callable[[], Compressor]) -> None:
    rng = np.random.default_rng(11)
    steps = [[rng.standard_normal((16, 16)).astype(np.float32) for _ in range(2)] for _ in range(3)]
    steps[0][0][0, 0] = np.inf  # one overflowed step on rank 0

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        c = make()
        plain = comm.allreduce(steps[0][comm.rank], plait.AVG)
        keyed = c.with_key("w")
        got = [comm.allreduce(xs[comm.rank], plait.AVG, compression=keyed) for xs in steps]
        state = c._state(comm, "w", steps[0][comm.rank])
        for kept in (state,) if isinstance(state, np.ndarray) else (state.q, state.error):
            assert np.isfinite(kept).all(), "the state kept a non-finite number"
        return [plain, *got]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_ranks(2, body)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    for res in results:
        for a, b in zip(res, results[0], strict=True):
            assert a.tobytes() == b.tobytes()
    plain, first, *later = results[0]
    assert not np.isfinite(first).all()  # the step with inf is not finite, as plain's is not
    assert not np.isfinite(first[0, 0])
    assert not np.isfinite(plain[0, 0])
    for res in later:
        assert np.isfinite(res).all(), "a finite step after the inf is still poisoned"


# -- keys are claimed at the call (Note [state claims]) --------------------------------------------
@pytest.mark.parametrize("make", [lambda: TopK(0.5), lambda: PowerSGD(1)], ids=["topk", "powersgd"])
def test_async_call_claims_its_key_at_the_call(make: Callable[[], Compressor]) -> None:
    def body(comm: plait.Communicator) -> list[np.ndarray]:
        keyed = make().with_key("k")
        x = np.ones((30, 40), np.float32)
        first = comm.allreduce(x, compression=keyed, async_op=True)
        for other in (np.ones((40, 30), np.float32), np.ones(5, np.float32)):
            with pytest.raises(ValueError, match="Give each tensor its own key"):
                comm.allreduce(other, compression=keyed, async_op=True)
            with pytest.raises(ValueError, match="Give each tensor its own key"):
                comm.allreduce(other, compression=keyed)
        # The refused calls moved nothing and took no call numbers: the calls below still
        # match on every rank (the byte counters, which the first call moves meanwhile on
        # its worker thread, cannot say so).
        second = comm.allreduce(x, compression=keyed, async_op=True)  # the same shape: fine
        out = [first.wait(30), second.wait(30), comm.allreduce(np.ones(2), timeout=30)]
        return out

    for first, second, after in run_ranks(2, body):
        assert first.shape == second.shape == (30, 40)
        np.testing.assert_array_equal(after, [2.0, 2.0])


def test_a_powersgd_fallback_does_not_claim_its_key() -> None:
    def body(comm: plait.Communicator) -> np.ndarray:
        keyed = PowerSGD(1).with_key("k")
        comm.allreduce(np.ones((3, 3), np.float32), compression=keyed)  # falls back: no state
        res: np.ndarray = comm.allreduce(np.ones((30, 40), np.float32), compression=keyed)
        return res

    for res in run_ranks(2, body):
        assert res.shape == (30, 40)
