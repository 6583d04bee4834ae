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
by chunk so that memory stays bounded for any size, with
:func:`plait.testing.reference`, and counts the elements that differ (floats
within a few ulps, to allow another order of summation; everything else
exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.ops import Op, dtype_family
from plait.testing import reference

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
        if collective == "broadcast":
            if rank == root and self.out is not None:
                fill(self.out, rank)
            return
        if self.inp is not None:
            fill(self.inp, rank)


def make_buffers(
    collective: str, rank: int, size: int, root: int, count: int, dtype: np.dtype, in_place: bool
) -> Buffers:
    """This rank's buffers for a row whose buffer S holds ``count`` elements (not yet filled)."""
    k = count // size
    is_root = rank == root
    if collective == "barrier":
        return Buffers(None, None)
    if collective == "broadcast":
        buf = np.zeros(count, dtype)
        return Buffers(buf, buf)
    if collective in ("allreduce", "alltoall"):
        inp = np.zeros(count, dtype)
        return Buffers(inp, inp if in_place else np.zeros(count, dtype))
    if collective == "reduce":
        inp = np.zeros(count, dtype)
        out = (inp if in_place else np.zeros(count, dtype)) if is_root else None
        return Buffers(inp, out)
    if collective == "reduce_scatter":
        inp = np.zeros(count, dtype)
        if in_place:
            return Buffers(inp, inp[rank * k : (rank + 1) * k], nested=True)
        return Buffers(inp, np.zeros(k, dtype))
    if collective == "allgather":
        out = np.zeros(count, dtype)
        if in_place:
            return Buffers(out[rank * k : (rank + 1) * k], out, nested=True)
        return Buffers(np.zeros(k, dtype), out)
    if collective == "gather":
        if not is_root:
            return Buffers(np.zeros(k, dtype), None)
        out = np.zeros(count, dtype)
        if in_place:
            return Buffers(out[rank * k : (rank + 1) * k], out, nested=True)
        return Buffers(np.zeros(k, dtype), out)
    if collective == "scatter":
        if not is_root:
            return Buffers(None, np.zeros(k, dtype))
        inp = np.zeros(count, dtype)
        if in_place:
            return Buffers(inp, inp[rank * k : (rank + 1) * k], nested=True)
        return Buffers(inp, np.zeros(k, dtype))
    raise ValueError(f"unknown collective {collective!r}")


# (offset in this rank's output, length, source ranks, offset in their inputs, reduced?)
_Segment = tuple[int, int, tuple[int, ...], int, bool]


def _segments(collective: str, rank: int, size: int, root: int, count: int) -> list[_Segment]:
    k = count // size
    every = tuple(range(size))
    if collective == "allreduce" or (collective == "reduce" and rank == root):
        return [(0, count, every, 0, True)]
    if collective == "broadcast":
        return [(0, count, (root,), 0, False)]
    if collective == "reduce_scatter":
        return [(0, k, every, rank * k, True)]
    if collective == "allgather" or (collective == "gather" and rank == root):
        return [(q * k, k, (q,), 0, False) for q in range(size)]
    if collective == "alltoall":
        return [(q * k, k, (q,), rank * k, False) for q in range(size)]
    if collective == "scatter":
        return [(0, k, (root,), rank * k, False)]
    return []  # barrier; reduce and gather off root return nothing


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
    total = 0
    for out_off, length, sources, src_off, reduced in _segments(
        collective, rank, size, root, count
    ):
        if not length:
            continue
        if out is None:
            raise ValueError(f"{collective} on rank {rank}: no result to check")
        for j in range(0, length, _CHUNK):
            n = min(_CHUNK, length - j)
            inputs = [pattern(q, src_off + j, n, dtype) for q in sources]
            want = reference("allreduce", inputs, op=op)[0] if reduced else inputs[0]
            assert want is not None
            total += _mismatches(out[out_off + j : out_off + j + n], want, size)
    return total
