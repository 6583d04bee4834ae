"""Every compressor: the same bits on every rank, and the numbers its numpy model gives."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from compression_models import (
    bf16_bits_scalar,
    int8_allreduce,
    powersgd_steps,
    topk_steps,
)

import plait
from plait.compression import BF16, FP16, Compressor, Int8, PowerSGD, TopK
from plait.compression.cast import BF16_SUM, from_bf16_bits, to_bf16_bits
from plait.compression.int8 import dequantize, quantize
from plait.compression.powersgd import low_rank_product, orthogonalize
from plait.testing import run_ranks


def inputs(size: int, shape: tuple[int, ...], dtype: Any = np.float32, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(size)]


def reduce_on_ranks(
    xs: list[np.ndarray], make: Callable[[], Compressor], op: plait.Op = plait.SUM, calls: int = 1
) -> list[list[np.ndarray]]:
    """``calls`` compressed allreduces of xs[rank] on every rank; [rank][call] results."""

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        c = make()
        x = xs[comm.rank]
        before = x.copy()
        got = [comm.allreduce(x, op, compression=c) for _ in range(calls)]
        assert np.array_equal(x, before), "x was modified"
        return got

    return run_ranks(len(xs), body)


def assert_identical(results: list[list[np.ndarray]]) -> None:
    first = results[0]
    for r, res in enumerate(results):
        for a, b in zip(res, first, strict=True):
            assert a.dtype == b.dtype
            assert a.shape == b.shape
            assert a.tobytes() == b.tobytes(), f"rank {r} differs from rank 0"


ALL: dict[str, Callable[[], Compressor]] = {
    "fp16": FP16,
    "bf16": BF16,
    "int8": lambda: Int8(block_size=16),
    "int8-stochastic": lambda: Int8(block_size=16, stochastic=True, seed=3),
    "topk": lambda: TopK(0.1),
    "powersgd": lambda: PowerSGD(2),
}


# -- identical everywhere, for every method, shape, dtype and world size -----------------------
@pytest.mark.parametrize("name", ALL)
# the quick loop (-m "not slow") checks 3 ranks; the full suite 1 and 4 too
@pytest.mark.parametrize(
    "size", [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(4, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize(
    "shape", [(0,), (1,), (5,), (37, 11), (64, 48), (4, 3, 10)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_identical_on_every_rank(name: str, size: int, shape: tuple, dtype: Any) -> None:
    xs = inputs(size, shape, dtype, seed=size)
    for op in (plait.SUM, plait.AVG):
        results = reduce_on_ranks(xs, ALL[name], op, calls=2)
        assert_identical(results)
        exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
        if op is plait.AVG:
            exact = exact / size
        got = results[0][0]
        assert got.shape == shape
        assert got.dtype == dtype
        if name in ("fp16", "bf16", "int8", "int8-stochastic") and exact.size:
            # dense methods: close to the exact reduction
            scale = np.max(np.abs(exact)) + 1e-3
            tol = {"fp16": 5e-3, "bf16": 3e-2, "int8": 6e-2, "int8-stochastic": 0.12}[name]
            if dtype == np.float16:
                tol += 5e-3
            assert np.max(np.abs(got - exact)) <= tol * scale * size


# -- casts ---------------------------------------------------------------------------------------
def test_bf16_rounding_matches_the_rule() -> None:
    rng = np.random.default_rng(1)
    special = np.array(
        [0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, 1.00390625, 1.01171875],
        np.float32,
    )  # 1.00390625 and 1.01171875 are ties: to even, down and up
    values = np.concatenate([special, rng.standard_normal(2000).astype(np.float32) * 1e3])
    values = np.concatenate(
        [values, rng.integers(0, 2**32, 2000, np.uint64).astype(np.uint32).view(np.float32)]
    )
    bits = to_bf16_bits(values)
    assert bits.dtype == np.uint16
    assert [int(b) for b in bits] == [bf16_bits_scalar(float(v)) for v in values]
    assert from_bf16_bits(to_bf16_bits(np.float32([1.00390625])))[0] == 1.0
    assert from_bf16_bits(to_bf16_bits(np.float32([1.01171875])))[0] == 1.015625


def test_bf16_matches_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(2)
    values = rng.integers(0, 2**32, 100_000, np.uint64).astype(np.uint32).view(np.float32)
    values = values[~np.isnan(values)]
    with np.errstate(over="ignore"):
        want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(to_bf16_bits(values), want)
    a, b = to_bf16_bits(values[:5000]), to_bf16_bits(values[5000:10000])
    with np.errstate(over="ignore", invalid="ignore"):
        want_sum = (a.view(ml_dtypes.bfloat16) + b.view(ml_dtypes.bfloat16)).view(np.uint16)
    got = BF16_SUM.ufunc(a, b.copy(), out=a.copy())
    same = (got == want_sum) | (np.isnan(from_bf16_bits(got)) & np.isnan(from_bf16_bits(want_sum)))
    assert same.all()


@pytest.mark.parametrize("make", [FP16, BF16])
def test_casts_are_exact_on_representable_sums(make: Callable[[], Compressor]) -> None:
    # Multiples of 1/8 below 16: exact in float16 and bfloat16, and so are their sums over
    # 4 ranks, whatever order the allreduce adds them in: the model is the exact sum.
    rng = np.random.default_rng(4)
    xs = [(rng.integers(-64, 64, (300,)) / 8).astype(np.float32) for _ in range(4)]
    results = reduce_on_ranks(xs, make)
    assert_identical(results)
    np.testing.assert_array_equal(results[0][0], np.sum(xs, axis=0))
    results = reduce_on_ranks(xs, make, plait.AVG)
    np.testing.assert_array_equal(results[0][0], np.sum([x / 4 for x in xs], axis=0))


def test_fp16_close_to_model_on_random_data() -> None:
    xs = inputs(4, (1000,))
    got = reduce_on_ranks(xs, FP16)[0][0]
    model = np.sum([x.astype(np.float16).astype(np.float64) for x in xs], axis=0)
    np.testing.assert_allclose(got, model, rtol=0, atol=4 * 2.0**-10 * 8)


# -- int8 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize(("size", "count", "block"), [(4, 1000, 32), (3, 77, 8), (2, 5, 256)])
def test_int8_matches_model_bit_for_bit(
    stochastic: bool, size: int, count: int, block: int
) -> None:
    xs = inputs(size, (count,), seed=count)
    xs[0][:block] = 0  # an all-zero block (scale 0)
    results = reduce_on_ranks(
        xs, lambda: Int8(block_size=block, stochastic=stochastic, seed=7), calls=2
    )
    assert_identical(results)
    model = int8_allreduce(xs, block, stochastic=stochastic, seed=7, calls=2)
    for got, want in zip(results[0], model, strict=True):
        np.testing.assert_array_equal(got, want)
    if stochastic:
        assert not np.array_equal(results[0][0], results[0][1]), "the draws did not advance"
    else:
        np.testing.assert_array_equal(results[0][0], results[0][1])


def test_int8_stochastic_rounding_is_unbiased() -> None:
    v = np.full(4096, 0.3, np.float32)
    v[0] = 1.0  # scale 1/127: 0.3 is 38.1 steps, between codes 38 and 39
    rng = np.random.default_rng(0)
    codes, scales = quantize(v, 4096, rng.random(4096, dtype=np.float32))
    back = dequantize(codes, scales, 4096)
    assert set(np.unique(codes[1:])) == {38, 39}
    assert abs(back[1:].mean() - 0.3) < 2e-3
    nearest = dequantize(*quantize(v, 4096), 4096)
    assert np.all(nearest[1:] == np.float32(38) * scales[0])


def test_int8_non_finite_block_becomes_nan() -> None:
    v = np.ones(64, np.float32)
    v[3] = np.inf
    back = dequantize(*quantize(v, 16), 16)
    assert np.isnan(back[:16]).all()
    assert np.all(back[16:] == 1.0)


# -- top-k ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("size", "shape", "ratio"), [(4, (50, 20), 0.05), (3, (101,), 0.2)])
def test_topk_matches_model_over_steps(size: int, shape: tuple, ratio: float) -> None:
    steps = [inputs(size, shape, seed=s) for s in range(3)]

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        c = TopK(ratio)
        grad = np.empty(shape, np.float32)  # one buffer across steps: its identity keys the state
        out = []
        for xs in steps:
            grad[...] = xs[comm.rank]
            out.append(comm.allreduce(grad, compression=c))
        return out

    results = run_ranks(size, body)
    assert_identical(results)
    for got, want in zip(results[0], topk_steps(steps, ratio), strict=True):
        np.testing.assert_array_equal(got, want)


def test_topk_error_feedback_loses_nothing() -> None:
    # The same input every step: whatever has not been sent yet is in the residuals, so the
    # sum of all results plus every rank's residual is exactly steps * the true sum.
    xs = inputs(2, (100,))
    steps = 40

    def body(comm: plait.Communicator) -> tuple[np.ndarray, np.ndarray]:
        c = TopK(0.1)
        total = np.zeros(100, np.float64)
        for _ in range(steps):
            total += comm.allreduce(xs[comm.rank], compression=c.with_key("w"))
        return total, c._state(comm, "w", xs[comm.rank])

    (total, res0), (_, res1) = run_ranks(2, body)
    np.testing.assert_allclose(total + res0 + res1, steps * (xs[0] + xs[1]), rtol=1e-5, atol=1e-4)
    assert np.count_nonzero(res0) > 0


def test_topk_without_error_feedback_keeps_no_state() -> None:
    c = TopK(0.1, error_feedback=False)
    assert not c.stateful
    xs = inputs(2, (100,))
    results = reduce_on_ranks(xs, lambda: c, calls=2)
    np.testing.assert_array_equal(results[0][0], results[0][1])


# -- PowerSGD -------------------------------------------------------------------------------------
def test_orthogonalize_and_product() -> None:
    rng = np.random.default_rng(5)
    p = rng.standard_normal((40, 3)).astype(np.float32)
    orthogonalize(p)
    np.testing.assert_allclose(p.T @ p, np.eye(3), atol=1e-5)
    z = np.zeros((5, 2), np.float32)
    assert np.array_equal(orthogonalize(z), np.zeros((5, 2)))  # zero stays zero, no NaN
    # Columns of one direction: what is left of the later ones is rounding, and is zeroed
    # (Note [rank-deficient matrices]), not normalised into more unit columns.
    one = np.multiply.outer(rng.standard_normal(40), rng.standard_normal(4)).astype(np.float32)
    norms = np.sqrt(np.sum(orthogonalize(one) ** 2, axis=0))
    np.testing.assert_allclose(norms, [1, 0, 0, 0], atol=1e-6)
    q = rng.standard_normal((7, 3)).astype(np.float32)
    np.testing.assert_allclose(low_rank_product(p, q), p @ q.T, rtol=1e-5, atol=1e-6)


def test_powersgd_is_exact_on_low_rank_sums() -> None:
    # Every rank's matrix is u_r v^T with one v: the sum has rank 1, which rank-1 PowerSGD
    # recovers exactly (up to rounding).
    rng = np.random.default_rng(6)
    v = rng.standard_normal(30)
    xs = [np.outer(rng.standard_normal(40), v).astype(np.float32) for _ in range(4)]
    results = reduce_on_ranks(xs, lambda: PowerSGD(1))
    assert_identical(results)
    np.testing.assert_allclose(results[0][0], np.sum(xs, axis=0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("rank", "kind"), [(2, "outer"), (4, "outer"), (4, "constant")])
def test_powersgd_of_a_higher_rank_than_the_matrix_is_exact(rank: int, kind: str) -> None:
    """A matrix of lower rank than PowerSGD's left columns of P that one pass of Gram-Schmidt
    reduced to rounding, normalised into a second copy of the matrix's direction: a constant
    matrix at rank 4 came out 2.0 times too large, an outer product at rank 2 1.19 times
    (Note [rank-deficient matrices] in plait.compression.powersgd)."""
    rng = np.random.default_rng(7)
    u, v = rng.standard_normal(64), rng.standard_normal(32)
    one = np.outer(u, v) if kind == "outer" else np.ones((64, 32))
    xs = [((r + 1) * one).astype(np.float32) for r in range(2)]
    results = reduce_on_ranks(xs, lambda: PowerSGD(rank))
    assert_identical(results)
    np.testing.assert_allclose(results[0][0], 3 * one, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("average", [False, True])
def test_powersgd_matches_model_over_steps(average: bool) -> None:
    shape, rank, seed = (48, 32), 2, 11
    steps = [inputs(3, shape, seed=s) for s in range(4)]

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        c = PowerSGD(rank, seed=seed)
        op = plait.AVG if average else plait.SUM
        return [comm.allreduce(xs[comm.rank], op, compression=c.with_key("w")) for xs in steps]

    results = run_ranks(3, body)
    assert_identical(results)
    q0 = np.random.default_rng([seed, 48, 32, rank]).standard_normal((32, rank))
    for got, want in zip(results[0], powersgd_steps(steps, rank, q0, average=average), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_powersgd_falls_back_for_small_tensors() -> None:
    c = PowerSGD(4)
    assert c.matrix_shape((100,)) is None  # 1-D
    assert c.matrix_shape((10, 10)) is None  # (10 + 10) * 4 * 2 >= 100
    assert c.matrix_shape((100, 100)) == (100, 100)
    assert c.matrix_shape((8, 3, 20)) == (8, 60) or c.matrix_shape((8, 3, 20)) is None
    xs = inputs(3, (10, 10))
    results = reduce_on_ranks(xs, lambda: c, calls=2)
    assert_identical(results)
    want = plait.testing.reference("allreduce", xs, op=plait.SUM)[0]
    np.testing.assert_allclose(results[0][0], want, rtol=1e-6)


def test_powersgd_without_warm_start_draws_the_same_q_everywhere() -> None:
    xs = inputs(3, (64, 64))
    results = reduce_on_ranks(xs, lambda: PowerSGD(2, warm_start=False, error_feedback=False))
    assert_identical(results)
    assert not PowerSGD(2, warm_start=False, error_feedback=False).stateful


# -- state ----------------------------------------------------------------------------------------
def test_state_is_kept_per_key_and_per_identity() -> None:
    xs = inputs(2, (200,))

    def body(comm: plait.Communicator) -> tuple:
        c = TopK(0.05)
        a, b = xs[comm.rank].copy(), xs[comm.rank].copy()
        first_a = comm.allreduce(a, compression=c)
        first_b = comm.allreduce(b, compression=c)  # another array: fresh state
        second_a = comm.allreduce(a, compression=c)  # a's residual applies
        named = [comm.allreduce(xs[comm.rank], compression=c.with_key("n")) for _ in range(2)]
        table = c._table(comm)
        n_before = len(table)
        del a
        gc.collect()
        n_after = len(table)
        c.reset()
        return first_a, first_b, second_a, named, n_before, n_after, len(table)

    for first_a, first_b, second_a, named, n_before, n_after, n_reset in run_ranks(2, body):
        np.testing.assert_array_equal(first_a, first_b)
        assert not np.array_equal(first_a, second_a)
        np.testing.assert_array_equal(named[0], first_a)
        np.testing.assert_array_equal(named[1], second_a)
        assert (n_before, n_after, n_reset) == (3, 2, 0)


def test_state_shape_mismatch_is_refused_before_any_byte_moves() -> None:
    def body(comm: plait.Communicator) -> None:
        for c in (TopK(0.1), PowerSGD(1)):
            keyed = c.with_key("w")
            comm.allreduce(np.ones((64, 64), np.float32), compression=keyed)
            before = comm.stats()
            with pytest.raises(ValueError, match="Give each tensor its own key"):
                comm.allreduce(np.ones((32, 64), np.float32), compression=keyed)
            assert comm.stats() == before
            c.reset()
            comm.allreduce(np.ones((32, 64), np.float32), compression=keyed)

    run_ranks(2, body)


@pytest.mark.parametrize(
    ("first", "then"),
    [((64, 64), (32, 128)), ((8, 3, 20), (8, 60)), ((4, 50), (200,))],
    ids=["same-count", "same-matrix", "same-count-1d"],
)
def test_a_key_reused_for_another_shape_of_the_same_size_is_refused(
    first: tuple[int, ...], then: tuple[int, ...]
) -> None:
    """The docs' promise is about the shape: not only the element count or PowerSGD's matrix."""

    assert PowerSGD(1).matrix_shape(first) is not None  # compressed: it keeps state

    def body(comm: plait.Communicator) -> None:
        for c in (TopK(0.1), PowerSGD(1)):
            keyed = c.with_key("w")
            comm.allreduce(np.ones(first, np.float32), compression=keyed)
            before = comm.stats()
            with pytest.raises(ValueError, match="Give each tensor its own key"):
                comm.allreduce(np.ones(then, np.float32), compression=keyed)
            assert comm.stats() == before

    run_ranks(2, body)


def test_one_compressor_shared_by_thread_ranks() -> None:
    # State lives per communicator, so threads that play ranks may share one object.
    shared = TopK(0.1)
    xs = inputs(3, (90,))
    results = reduce_on_ranks(xs, lambda: shared, calls=2)
    assert_identical(results)
    want = topk_steps([xs, xs], 0.1)
    for got, w in zip(results[0], want, strict=True):
        np.testing.assert_array_equal(got, w)
