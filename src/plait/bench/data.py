"""Each rank's buffers, the data they start with, and the wrong-element check.

Rank q's input element i is a function of ``v = ((i + 31 q) mod 251) + 1``:
``v`` itself in most dtypes (small positive integers, exact in every dtype,
bfloat16 included), ``v mod 127 + 1`` in int8, and a scrambled bit of ``v`` in
bool (so that AND and OR over ranks give both values). Every rank has a
different sequence, with a period (251, prime) that no block size of a sweep
is a multiple of, so a block sent to the wrong place or a rank read twice
changes the result. Output buffers start at zero.

Buffers are flat. In place means what it means in nccl-tests: the output is
the input (allreduce, reduce, alltoall), or the input is this rank's block of
the output (allgather, gather on root), or the output is this rank's block of
the input (reduce_scatter, scatter on root). Broadcast is always in place.

The check rebuilds the expected result of this rank from the pattern, chunk
by chunk so that memory stays bounded for any size, from the pieces the table
of collectives gives for it (:attr:`plait.collectives.Collective.pieces`,
reduced with :func:`plait.collectives.fold`, as the numpy reference does),
and counts the elements that differ (floats within a few ulps, to allow
another order of summation; everything else exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.collectives import fold
from plait.collectives import get as _collective
from plait.ops import Op, dtype_family

__all__ = ["Buffers", "count_wrong", "fill", "make_buffers", "pattern", "resolve_dtype"]

_PERIOD = 251
_RANK_SHIFT = 31
#: Elements per chunk of the check (bounds its memory).
_CHUNK = 1 << 20


def resolve_dtype(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (``bfloat16`` through ml_dtypes).

    Raises:
        ValueError: unknown name, or bfloat16 without ml_dtypes.
    """
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("bfloat16 needs ml_dtypes: pip install 'plait[bfloat16]'") from None
        bf16: np.dtype = np.dtype(ml_dtypes.bfloat16)
        return bf16
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None


def pattern(rank: int, start: int, n: int, dtype: np.dtype) -> np.ndarray:
    """Elements ``start .. start+n`` of rank ``rank``'s input (see the module doc)."""
    v = (np.arange(start, start + n, dtype=np.int64) + _RANK_SHIFT * rank) % _PERIOD + 1
    family = dtype_family(dtype)
    if family == "bool":
        odd: np.ndarray = (v * 73 % _PERIOD) % 2 == 1
        return odd
    if dtype == np.int8:
        v = v % 127 + 1
    if family == "complex":
        return (v + 1j * (v % 7)).astype(dtype)
    if family == "float":
        return v.astype(np.float32).astype(dtype)
    return v.astype(dtype)


def fill(buf: np.ndarray, rank: int, start: int = 0) -> None:
    """Write elements ``start ..`` of rank ``rank``'s input into the flat ``buf``.

    One period-aligned block is computed and then copied, so filling runs at
    memory speed.
    """
    n = buf.size
    block = min(n, _PERIOD * 4096)
    if block == 0:
        return
    base = pattern(rank, start, block, buf.dtype)
    for off in range(0, n, block):
        m = min(block, n - off)
        buf[off : off + m] = base[:m]


@dataclass
class Buffers:
    """One rank's flat input and output (either may be None; they may share memory)."""

    inp: np.ndarray | None
    out: np.ndarray | None
    #: Whether ``inp`` is rank's block of ``out`` or ``out`` rank's block of ``inp``.
    nested: bool = False

    def reset(self, collective: str, rank: int, root: int) -> None:
        """Zero the output, then write this rank's input pattern (root's for broadcast)."""
        if self.out is not None:
            self.out.fill(0)
        if _collective(collective).fills_x:
            if rank == root and self.out is not None:
                fill(self.out, rank)
            return
        if self.inp is not None:
            fill(self.inp, rank)


def make_buffers(
    collective: str, rank: int, size: int, root: int, count: int, dtype: np.dtype, in_place: bool
) -> Buffers:
    """This rank's buffers for a row whose buffer S holds ``count`` elements (not yet filled).

    Their lengths are the schedule's (:meth:`plait.collectives.Collective.counts`),
    which are linear in the unit count: per unit, a rank has 0, 1 or ``size``
    elements of input and of output. In place, equal lengths share one array
    and unequal ones nest the shorter at this rank's block of the longer.
    """
    table = _collective(collective)
    if table.synchronizes:
        return Buffers(None, None)
    k = table.unit_count(count, size)
    if table.fills_x:
        buf = np.zeros(count, dtype)
        return Buffers(buf, buf)
    per_in, per_out = table.counts(size, 1, rank, root)
    if not per_out:
        return Buffers(np.zeros(per_in * k, dtype), None)
    if not per_in:
        return Buffers(None, np.zeros(per_out * k, dtype))
    if not in_place:
        return Buffers(np.zeros(per_in * k, dtype), np.zeros(per_out * k, dtype))
    if per_in == per_out:
        inp = np.zeros(per_in * k, dtype)
        return Buffers(inp, inp)
    if per_in > per_out:
        inp = np.zeros(per_in * k, dtype)
        return Buffers(inp, inp[rank * k : (rank + 1) * k], nested=True)
    out = np.zeros(per_out * k, dtype)
    return Buffers(out[rank * k : (rank + 1) * k], out, nested=True)


def _eps(dtype: np.dtype) -> float:
    try:
        return float(np.finfo(dtype).eps)
    except ValueError:  # ml_dtypes' floats
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).eps)


def _mismatches(got: np.ndarray, want: np.ndarray, size: int) -> int:
    family = dtype_family(want.dtype)
    if family not in ("float", "complex"):
        return int(np.count_nonzero(got != want))
    tol = 4 * size * _eps(want.dtype)
    if want.dtype.kind not in "fc":  # bfloat16: compare in float32
        got, want = got.astype(np.float32), want.astype(np.float32)
    close = np.isclose(got, want, rtol=tol, atol=0.0, equal_nan=True)
    return int(close.size - np.count_nonzero(close))


def count_wrong(
    collective: str,
    rank: int,
    size: int,
    root: int,
    op: Op | None,
    count: int,
    out: np.ndarray | None,
    dtype: np.dtype,
) -> int:
    """Elements of this rank's flat result ``out`` that differ from the numpy reference.

    The inputs are those :meth:`Buffers.reset` wrote. Returns 0 where the
    collective returns nothing on this rank.
    """
    table = _collective(collective)
    pieces = table.pieces(size, table.unit_count(count, size), rank, root) or ()
    total = 0
    for out_off, length, sources, src_off, reduced in pieces:
        if not length:
            continue
        if out is None:
            raise ValueError(f"{collective} on rank {rank}: no result to check")
        for j in range(0, length, _CHUNK):
            n = min(_CHUNK, length - j)
            inputs = [pattern(q, src_off + j, n, dtype) for q in sources]
            if reduced:
                if op is None:
                    raise ValueError(f"{collective} reduces: pass op=")
                want = fold(op, inputs, size)
            else:
                want = inputs[0]
            total += _mismatches(out[out_off + j : out_off + j + n], want, size)
    return total
