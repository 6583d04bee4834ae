"""int8 with one scale per block: a quarter of float32's bytes, plus the scales.

The sum of quantized vectors is not a quantized vector, so this is a
reduce-scatter and an allgather written out by hand, quantizing in front of
each (like a ring allreduce whose partial sums are re-quantized once)::

    x (count elements), padded to size * shard, cut into size shards
    1. quantize every shard          -> alltoall: rank r gets shard r of every rank
    2. dequantize those size shards, sum them in rank order, quantize the sum
    3. allgather the quantized sums  -> every rank dequantizes the same bytes

Step 2 runs on one rank per shard, so the order of the additions is fixed,
and every rank dequantizes the same int8 values and scales in step 3: the
result is identical bit for bit everywhere. It carries two quantization
errors (each rank's input, then the shard's sum), each at most half a step
(``max|block| / 127 / 2``) with nearest rounding.

Quantizing a block of ``block_size`` values: ``scale = max|v| / 127``,
``q = round(v / scale)`` in -127..127, dequantized as ``q * scale``. Everything,
the scales on the wire included, is float32, and float64 for float64 data:
float32 scales would turn float64 values beyond float32's range into inf and
NaN, and those below its smallest into 0. With ``AVG`` the sum is divided by
the number of ranks in that precision, before the cast to ``x``'s dtype, so a
mean that float16 can hold does not overflow. A block of
zeros has scale 0; a block with an inf or NaN dequantizes to NaN, so a
non-finite gradient is not silently dropped. Rounding is to nearest (ties to
even) or stochastic, ``floor(v / scale + u)`` with ``u`` uniform in [0, 1),
unbiased: ``E[q * scale] = v``. Stochastic draws come from
``np.random.default_rng([seed, rank])``, one generator per rank and
communicator, so runs are reproducible and the ranks' noise is independent;
per call a rank draws ``size * shard`` numbers for step 1, then ``shard`` for
step 2.

Note [the edges of the float range]
    A block of finite values dequantizes to finite values, and a block of
    values too small for ``max|v| / 127`` to be a number of the working
    precision still gets a step. At the top, ``127 * (max|v| / 127)`` may round
    past the largest finite number (float32's or float64's maximum itself
    does), which gave inf and then, in the block's sum, NaN: a product past
    it is clamped to the largest finite number, which is within half a step
    of the value. At the bottom, ``max|v| / 127`` of a block of subnormals
    underflowed to 0, and every value of the block to 0 with it: a block
    whose largest magnitude is above 0 gets a scale of at least the smallest
    subnormal of the working precision, so its values come back to within
    half a step (exactly, there: they are multiples of that step). A block
    with an inf or NaN still dequantizes to NaN.

The allgather's rows start with the call's 16-byte header, so that ranks
that passed different counts, dtypes or ops all raise MismatchError (Note
[call headers] in :mod:`plait.compression.base`).

Bytes one rank sends per call:
``2 (size - 1) (shard + 4 ceil(shard / block_size)) + 16 (size - 1)`` with
``shard = ceil(count / size)`` (8 bytes a scale for float64 data), against
``2 (size - 1) / size * 4 count`` for a float32 ring allreduce: about 1/4, plus
4 / block_size for the scales (and the headers' 16 bytes a rank).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from plait.compression.base import (
    HEADER_BYTES,
    Compressor,
    call_header,
    check_headers,
    check_seed,
    work_dtype,
)

if TYPE_CHECKING:
    from plait.communicator import Communicator

__all__ = ["Int8", "dequantize", "quantize"]

_LEVELS = 127  # symmetric: -127..127, so negating a block negates its codes


def quantize(
    v: np.ndarray, block_size: int, noise: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes and per-block scales of each row of ``v`` (the last block may be short).

    Args:
        v: values, 1-D or 2-D (rows quantized separately, blocks starting at
            each row's first element); computed in float64 when float64,
            else converted to float32.
        block_size: elements per scale.
        noise: uniforms in [0, 1) of ``v``'s shape for stochastic rounding;
            None rounds to nearest.

    Returns:
        ``(codes, scales)``: int8 of ``v``'s shape, and scales in the working
        precision (float32, or float64 for float64 ``v``) with
        ``ceil(n / block_size)`` scales per row (``n`` the row length).
    """
    v = np.asarray(v)
    wd = work_dtype(v.dtype)
    v = v.astype(wd, copy=False)
    rows = v.reshape(math.prod(v.shape[:-1]), v.shape[-1]) if v.ndim else v.reshape(1, 1)
    count, n = rows.shape
    blocks = -(-n // block_size)
    grid = _blocks(rows, blocks, block_size, wd)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        peak = np.abs(grid).max(axis=2, initial=0.0)
        scales = peak / wd.type(_LEVELS)
        # Note [the edges of the float range]: a step of at least the smallest subnormal
        scales = np.where(peak > 0, np.maximum(scales, np.finfo(wd).smallest_subnormal), scales)
        safe = np.where(scales > 0, scales, wd.type(1))  # inf: codes 0, NaN again below
        y = (grid / safe[:, :, None]).reshape(count, -1)[:, :n]
        y = np.rint(y) if noise is None else np.floor(y + np.asarray(noise, wd).reshape(count, n))
    np.clip(y, -_LEVELS, _LEVELS, out=y)
    nan = np.isnan(y)  # NaN input, or inf / inf in a block with an inf
    if nan.any():
        y[nan] = 0  # code 0: the block's scale (inf or NaN) makes it NaN again
    codes = y.astype(np.int8)
    shape_scales = (*v.shape[:-1], blocks) if v.ndim else (blocks,)
    return codes.reshape(v.shape), scales.astype(wd, copy=False).reshape(shape_scales)


def dequantize(codes: np.ndarray, scales: np.ndarray, block_size: int) -> np.ndarray:
    """Values of :func:`quantize`'s output (1-D or 2-D, as it was given), in the scales' dtype."""
    rows = codes.reshape(math.prod(codes.shape[:-1]), codes.shape[-1])
    count, n = rows.shape
    blocks = scales.shape[-1]
    grid = _blocks(rows, blocks, block_size, scales.dtype)
    with np.errstate(invalid="ignore", over="ignore"):  # 0 * inf in a non-finite block: NaN
        grid = grid * scales.reshape(count, blocks, 1)
    top = np.finfo(scales.dtype).max
    with np.errstate(invalid="ignore"):  # (a NaN scale compares False)
        near_top = bool((scales > top / (2 * _LEVELS)).any())
    if near_top:  # Note [the edges of the float range]: 127 steps may round past the largest
        finite = np.isfinite(scales).reshape(count, blocks, 1)
        grid = np.where(finite, np.clip(grid, -top, top), grid)
    values: np.ndarray = grid.reshape(count, -1)[:, :n].reshape(codes.shape)
    return values


def _blocks(rows: np.ndarray, blocks: int, block_size: int, dtype: np.dtype) -> np.ndarray:
    """``rows`` as (rows, blocks, block_size) ``dtype``, zero-padded where the last is short."""
    count, n = rows.shape
    if n == blocks * block_size:
        return rows.astype(dtype, copy=False).reshape(count, blocks, block_size)
    padded = np.zeros((count, blocks * block_size), dtype)
    padded[:, :n] = rows
    return padded.reshape(count, blocks, block_size)


class Int8(Compressor):
    """int8 codes with one scale per ``block_size`` elements (float32; float64 for float64 data).

    Args:
        block_size: elements per scale (smaller: more accurate, more bytes).
        stochastic: stochastic rounding (unbiased) instead of round to nearest.
        seed: seeds every rank's generator for stochastic rounding.

    Stateless apart from the stochastic generators (one per rank and
    communicator; :meth:`reset` restarts them).
    """

    name = "int8"

    def __init__(self, block_size: int = 256, *, stochastic: bool = False, seed: int = 0) -> None:
        super().__init__()
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int | np.integer)
            or block_size < 1
        ):
            raise ValueError(f"Int8: block_size must be a positive int; got {block_size!r}")
        self.block_size = int(block_size)  # a numpy integer too, kept as Python's
        self.stochastic = bool(stochastic)
        self.seed = check_seed(seed, "Int8")
        if self.stochastic:
            self.name = "int8-stochastic"

    def __repr__(self) -> str:
        return (
            f"plait.compression.Int8(block_size={self.block_size}, "
            f"stochastic={self.stochastic}, seed={self.seed})"
        )

    def collectives(self, x: np.ndarray, comm: Communicator) -> int:
        """An alltoall and an allgather."""
        return 2

    def allreduce(
        self,
        comm: Communicator,
        x: np.ndarray,
        *,
        average: bool = False,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Quantize, alltoall, sum each shard in rank order, re-quantize, allgather, dequantize."""
        p = comm.size
        b = self.block_size
        wd = work_dtype(x.dtype)  # float64 data keeps float64's range and precision
        count = x.size
        shard = -(-count // p)
        blocks = -(-shard // b)
        scale_bytes = wd.itemsize * blocks
        part = scale_bytes + shard  # scales first: 4-byte aligned within the part
        rng = (
            self._shared(comm, "rng", lambda: np.random.default_rng([self.seed, comm.rank]))
            if self.stochastic
            else None
        )

        flat = np.zeros((p, shard), wd)  # native order (Note [byte order])
        with np.errstate(over="ignore"):
            flat.reshape(-1)[:count] = x.reshape(-1)
        noise = rng.random((p, shard), dtype=np.float32) if rng is not None else None
        codes, scales = quantize(flat, b, noise)  # every shard, blocks from its start
        send = np.empty((p, part), np.uint8)
        send[:, :scale_bytes] = scales.view(np.uint8)
        send[:, scale_bytes:] = codes.view(np.uint8)
        got = comm.alltoall(send.reshape(-1), timeout=timeout).reshape(p, part)

        parts = _unpack(got, scale_bytes, b, wd)
        total = np.zeros(shard, wd)
        with np.errstate(invalid="ignore", over="ignore"):
            for q in range(p):  # rank order: the same additions wherever this shard is summed
                total += parts[q]
        noise = rng.random(shard, dtype=np.float32) if rng is not None else None
        codes, scales = quantize(total, b, noise)
        h = HEADER_BYTES  # the call's header first (Note [call headers] in ...compression.base)
        mine = np.empty(h + part, np.uint8)
        mine[:h] = call_header(x, average)
        mine[h : h + scale_bytes] = scales.view(np.uint8)
        mine[h + scale_bytes :] = codes.view(np.uint8)
        rows = comm.allgather(mine, timeout=timeout)
        check_headers(rows, comm, self.name)
        out = _unpack(rows[:, h:], scale_bytes, b, wd).reshape(-1)[:count]
        with np.errstate(over="ignore", invalid="ignore"):
            if average:
                out /= np.asarray(p, wd)  # before the cast: a mean x's dtype holds stays finite
            result = out.astype(x.dtype)
        return result.reshape(x.shape)


def _unpack(parts: np.ndarray, scale_bytes: int, block_size: int, wd: np.dtype) -> np.ndarray:
    """Dequantize packed parts, one per row: (rows, part) uint8 -> (rows, shard) in ``wd``."""
    scales = np.ascontiguousarray(parts[:, :scale_bytes]).view(wd)
    codes = np.ascontiguousarray(parts[:, scale_bytes:]).view(np.int8)
    return dequantize(codes, scales, block_size)
