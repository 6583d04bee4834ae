"""fp16 and bf16 casts: half the bytes of float32, reduced by a plain allreduce.

A cast is linear enough to compose with allreduce: every rank casts, the
allreduce sums the 16-bit values (rounding after every addition, in the
order of the chosen algorithm, identical on every rank), and every rank casts
the sum back. With ``AVG`` each rank divides by the number of ranks *before*
the cast, as torch's ``fp16_compress_hook`` does, so the sum cannot overflow
where the mean would not.

bf16 needs no extra package: :func:`to_bf16_bits` rounds float32 to
bfloat16 (round to nearest, ties to even, NaN kept quiet) with integer
operations on the bit patterns, the wire carries them as uint16, and the
reduction is :data:`BF16_SUM`, an op that adds two bf16 bit patterns in
float32 and rounds the sum back, which is what a bfloat16 add does. The
results match ml_dtypes' bfloat16 bit for bit, from float64 too (rounded once,
Note [bf16 from float64]).

Bytes on the wire: those of an allreduce of ``count`` 2-byte elements, half of
float32's (a quarter of float64's).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from plait.compression.base import Compressor
from plait.ops import SUM, Op

if TYPE_CHECKING:
    from plait.communicator import Communicator

__all__ = ["BF16", "BF16_SUM", "FP16", "from_bf16_bits", "to_bf16_bits"]


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of ``x``, rounded to nearest, ties to even.

    Rounded once, from ``x``'s own value: float64 too (Note [bf16 from float64]);
    float16 widens to float32 exactly. NaNs stay NaN (quiet, sign kept);
    values beyond bfloat16's range become infinities, as in a hardware
    conversion.
    """
    x = np.asarray(x)
    if x.dtype.kind == "f" and x.dtype.itemsize == 8:
        f = _to_float32_odd(x)
    else:
        f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds to nearest and ties to even;
    # a carry out of the mantissa correctly bumps the exponent (to inf at the top).
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    bits = rounded.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        bits[nan] = ((u[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return bits


def _to_float32_odd(x: np.ndarray) -> np.ndarray:
    """float64 ``x`` as float32 rounded to odd: see Note [bf16 from float64].

    Note [bf16 from float64]
        Rounding float64 to float32 to nearest and then to bfloat16 to
        nearest rounds twice, and can land on the wrong side of a bfloat16
        tie: ``1 + 2**-8 + 2**-40`` becomes the tie ``1 + 2**-8`` in float32,
        which then goes to even, down, though the value is above the tie. So
        float64 goes to float32 rounded to odd instead: truncated toward
        zero, with the lowest bit set when anything was cut off. float32
        keeps 16 more bits than bfloat16 (well over the 2 that rounding to
        odd needs), so rounding the result to nearest gives the correctly
        rounded bfloat16 of ``x``, as ml_dtypes' direct conversion does.
        Past float32's range the truncation is float32's largest value,
        odd, which rounds to inf as ``x`` should; below it, zero with the
        lowest bit set, which rounds to zero.
    """
    x = np.ascontiguousarray(x, dtype=np.float64)  # native order
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float32's range: inf, fixed below
        f = x.astype(np.float32)
        inexact = (f.astype(np.float64) != x) & ~np.isnan(x)
    if inexact.any():
        g = f[inexact]
        over = np.abs(g.astype(np.float64)) > np.abs(x[inexact])
        g[over] = np.nextafter(g[over], np.float32(0))  # toward zero: the truncation
        u = g.view(np.uint32)
        u |= np.uint32(1)
        f[inexact] = g
    return f


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact: bfloat16 is float32 cut short)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _bf16_add(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Sum of two bfloat16 bit-pattern arrays, rounded to bfloat16 (``out`` may alias a or b)."""
    total = to_bf16_bits(from_bf16_bits(a) + from_bf16_bits(b))
    if out is None:
        return total
    out[...] = total
    return out


#: The reduction of bfloat16 bit patterns carried as uint16 (commutative: a + b == b + a).
BF16_SUM = Op(_bf16_add, name="bf16_sum", families=("int",))


class FP16(Compressor):
    """Cast to float16 for the wire; the allreduce sums in float16.

    float16 keeps 11 significant bits between about 6e-8 (subnormal) and
    65504; smaller gradients flush to zero and larger sums overflow to inf,
    so prefer :class:`BF16` when magnitudes vary widely. Stateless.
    """

    name = "fp16"

    def allreduce(
        self,
        comm: Communicator,
        x: np.ndarray,
        *,
        average: bool = False,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Cast, allreduce in float16, cast back to ``x.dtype``."""
        with np.errstate(over="ignore"):
            scaled = x / np.asarray(comm.size, x.dtype) if average else x
            payload = np.asarray(scaled, dtype=np.float16)
        total: np.ndarray = comm.allreduce(payload, SUM, timeout=timeout)
        return total.astype(x.dtype, copy=False).reshape(x.shape)


class BF16(Compressor):
    """Cast to bfloat16 for the wire (float32's range, 8 significant bits).

    Works without ml_dtypes (see the module docstring). Stateless.
    """

    name = "bf16"

    def allreduce(
        self,
        comm: Communicator,
        x: np.ndarray,
        *,
        average: bool = False,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Round to bfloat16, allreduce the bit patterns with :data:`BF16_SUM`, widen back."""
        scaled = x / np.asarray(comm.size, x.dtype) if average else x
        total = comm.allreduce(to_bf16_bits(scaled), BF16_SUM, timeout=timeout)
        return from_bf16_bits(total).astype(x.dtype, copy=False).reshape(x.shape)
