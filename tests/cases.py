"""Inputs for real-data tests: every collective x op x dtype family, exact by construction.

Values are chosen so that every partial result is exactly representable
(small integers in floats, ±1 products, wrapping integer arithmetic), so any
correct algorithm matches the numpy reference bit for bit, whatever order it
reduces in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import plait
from plait.ops import dtype_family

INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOATS = [np.float16, np.float32, np.float64, np.longdouble]
COMPLEXES = [np.complex64, np.complex128]


@functools.cache
def bfloat16() -> np.dtype | None:
    """ml_dtypes' bfloat16, or None without the extra.

    Imported on first use, not with this module: the import takes over a second,
    which every rank process of a multiprocess check would pay for nothing in the
    checks that use no bfloat16.
    """
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - the test extra installs it
        return None
    return np.dtype(ml_dtypes.bfloat16)


def all_dtypes() -> list[np.dtype]:
    """Every dtype the collectives take: bool, the integers, floats, complexes, bfloat16."""
    bf16 = bfloat16()
    plain = [np.dtype(d) for d in [np.bool_, *INTS, *FLOATS, *COMPLEXES]]
    return plain + ([bf16] if bf16 is not None else [])


def affine(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Compose affine maps a+bj ~ (t -> a t + b): associative, not commutative."""
    a1, b1, a2, b2 = x.real, x.imag, y.real, y.imag
    res = (a1 * a2) + 1j * (a1 * b2 + b1)
    out[...] = res
    return out


AFFINE = plait.Op(affine, commutative=False, name="affine")
GCD = plait.Op(np.gcd)
FMAX = plait.Op(np.fmax)


def op_dtypes(bf16: bool = True) -> list[tuple[plait.Op, np.dtype]]:
    """(op, dtype) pairs covering every op and every dtype family."""
    d = np.dtype
    pairs: list[tuple[plait.Op, np.dtype]] = [(plait.SUM, t) for t in all_dtypes()]
    pairs += [(plait.PROD, d(t)) for t in (np.int32, np.uint8, np.float64, np.complex64, np.bool_)]
    bf16_dtype = bfloat16() if bf16 else None
    extra = [bf16_dtype] if bf16_dtype is not None else []
    for op in (plait.MIN, plait.MAX):
        pairs += [(op, d(t)) for t in (np.int8, np.uint64, np.float16, np.float32, np.bool_)]
        pairs += [(op, t) for t in extra]
    pairs += [(plait.AVG, d(t)) for t in (np.float16, np.float32, np.complex128)]
    pairs += [(plait.AVG, t) for t in extra]
    for op in (plait.BAND, plait.BOR, plait.BXOR):
        pairs += [(op, d(t)) for t in (np.bool_, np.uint8, np.int64)]
    pairs += [(GCD, d(np.int32)), (FMAX, d(np.float64)), (AFFINE, d(np.complex128))]
    return pairs


def values(
    rng: np.random.Generator, dtype: np.dtype, op: plait.Op | None, shape: Any, size: int
) -> np.ndarray:
    """Random input of ``dtype`` whose reductions over ``size`` ranks are exact."""
    fam = dtype_family(dtype)
    if fam == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if op is AFFINE:
        a = rng.choice([-1.0, 1.0], shape)
        b = rng.integers(-3, 4, shape)
        return (a + 1j * b).astype(dtype)
    if op is GCD:
        return rng.integers(1, 50, shape).astype(dtype)
    if fam == "int":
        info = np.iinfo(dtype)
        if op in (plait.BAND, plait.BOR, plait.BXOR, plait.MIN, plait.MAX):
            return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
        # SUM/PROD wrap around modulo 2**bits: exact in any order.
        return rng.integers(info.min // 2, info.max // 2, shape, dtype=dtype)
    if op is plait.PROD:
        choices = [1, -1, 1j, -1j] if fam == "complex" else [1.0, -1.0]
        return np.asarray(rng.choice(choices, shape)).astype(dtype)
    # Floats: integers small enough that all partial sums are exact.
    limit = {"float16": 1000, "bfloat16": 100, "float32": 1 << 20, "complex64": 1 << 20}.get(
        dtype.name, 1 << 40
    )
    m = max(1, limit // max(size, 1))
    real = rng.integers(-m, m + 1, shape).astype(np.float64)
    if fam == "complex":
        real = real + 1j * rng.integers(-m, m + 1, shape)
    return real.astype(dtype)


@dataclass(frozen=True)
class Case:
    """One call: its per-rank input maker and the call itself."""

    name: str
    make: Callable[[int], np.ndarray]  # rank -> input
    call: Callable[[plait.Communicator, np.ndarray], Any]
    op: plait.Op | None
    root: int


def same(got: Any, want: Any) -> bool:
    """Equal shape, dtype and values (NaN-free data)."""
    if want is None or got is None:
        return got is None and want is None
    got = np.asarray(got)
    return got.shape == want.shape and got.dtype == want.dtype and bool(np.array_equal(got, want))


def bits(a: np.ndarray) -> bytes:
    """The bytes that carry a value (longdouble padding excluded)."""
    if a.dtype == np.longdouble and a.dtype.itemsize > 10:
        return a.astype(np.float64).tobytes()
    return np.ascontiguousarray(a).tobytes()
