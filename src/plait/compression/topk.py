"""Top-k sparsification with error feedback: send only the k largest entries.

Each rank adds its residual (what it has not sent yet) to its input, keeps the
``k`` entries of largest magnitude and carries the rest over to the next call
for the same tensor (error feedback, as in Seide et al. 2014 and Lin et al.'s
Deep Gradient Compression, 2018). Different ranks pick different indices, so
the sparse vectors cannot be summed in place by an allreduce: they are
allgathered (indices and values) and every rank adds them into a zero vector
in rank order, which makes the result identical bit for bit on every rank::

    acc      = x + residual            (float32; float64 for float64 data)
    idx      = the k indices of largest |acc|, ascending
    vals     = acc[idx] in x's dtype, native order   (what goes on the wire)
    residual = acc; residual[idx] -= vals   (exactly what was not sent)
    allgather (idx, vals) -> out = 0; for q in rank order: out[idx_q] += vals_q

``k = max(1, ceil(ratio * count))``. With ``AVG`` the sum is divided by the
number of ranks in the working precision, before the cast to ``x``'s dtype, so
a mean that ``x``'s dtype can hold does not overflow (float16). Values go on
the wire in native byte order (Note [byte order] in :mod:`plait.compression.base`).
The state per tensor is its residual, of the tensor's shape (so that a key
reused for another shape is refused, not only one of another element count);
see Note [compressor state] in :mod:`plait.compression.base`.
Without error feedback the unsent entries are simply dropped (biased: avoid).

Note [non-finite residuals]
    One inf or NaN in a gradient (an overflowed step under loss scaling, say)
    would stay in the residual for good: ``inf - inf`` is NaN, and NaN plus
    anything is NaN, so every later step of that tensor would be NaN. The
    step that holds it returns inf or NaN, as a plain allreduce would (the
    entry has the largest magnitude, so it is sent), but the residual keeps
    only finite entries: a non-finite one is reset to 0, and the next finite
    step recovers. What was not sent of that entry is lost, which is what
    skipping an overflowed step means anyway. The arithmetic on non-finite
    values raises no warning of numpy's: it is expected here.

Each rank's allgathered row starts with the call's 16-byte header, so that
ranks that passed different counts, dtypes or ops all raise MismatchError
(Note [call headers] in :mod:`plait.compression.base`).

Bytes one rank sends per call: ``(size - 1) * (16 + k * (4 + itemsize))`` (uint32
indices; uint64 past 2**32 elements), against ``2 (size - 1) / size * itemsize * count``
for a ring allreduce: a ratio of about ``size * k / count * (4 + itemsize) / (2 itemsize)``
(the headers add ``16 size / (2 itemsize count)``), which grows with the number of
ranks (the allgather's price).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.compression.base import HEADER_BYTES, Compressor, call_header, check_headers, work_dtype

if TYPE_CHECKING:
    from plait.communicator import Communicator

__all__ = ["TopK", "select_topk"]


def select_topk(acc: np.ndarray, k: int) -> np.ndarray:
    """Ascending indices of the ``k`` entries of largest magnitude of a 1-D array.

    Ties at the threshold are broken deterministically (by numpy's
    introselect on the same data), so a rank makes the same choice run after run.
    """
    n = acc.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    mag = np.abs(acc)
    idx = np.argpartition(mag, n - k)[n - k :]
    idx.sort()
    return idx


class TopK(Compressor):
    """Keep the ``ratio`` largest-magnitude entries per call, with error feedback.

    Args:
        ratio: fraction of entries sent, 0 < ratio <= 1 (k = max(1, ceil(ratio * count))).
        error_feedback: carry the unsent remainder over to the next call for
            the same tensor (strongly recommended: without it top-k is biased).

    State: one residual per tensor, keyed as Note [compressor state] says.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, *, error_feedback: bool = True) -> None:
        super().__init__()
        numeric = int | float | np.integer | np.floating
        if isinstance(ratio, bool) or not isinstance(ratio, numeric) or not 0 < ratio <= 1:
            raise ValueError(f"TopK: ratio must be in (0, 1]; got {ratio!r}")
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)

    def __repr__(self) -> str:
        return f"plait.compression.TopK(ratio={self.ratio}, error_feedback={self.error_feedback})"

    @property
    def stateful(self) -> bool:
        """True with error feedback (the residual)."""
        return self.error_feedback

    def k(self, count: int) -> int:
        """Entries sent per rank for a tensor of ``count`` elements."""
        return min(count, max(1, math.ceil(self.ratio * count)))

    def _check_state(
        self, state: Any, x: np.ndarray, comm: Communicator, key: Hashable | None
    ) -> None:
        want = (x.shape, work_dtype(x.dtype))
        if (state.shape, state.dtype) != want:
            raise ValueError(
                f"rank {comm.rank}: allreduce: {self.name}: the residual kept for "
                f"{'key ' + repr(key) if key is not None else 'this array'} has shape "
                f"{state.shape} and dtype {state.dtype}; x has {x.shape} and {x.dtype}. "
                "Give each tensor its own key (c.with_key(name)) or call reset()"
            )

    def allreduce(
        self,
        comm: Communicator,
        x: np.ndarray,
        *,
        average: bool = False,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Select, allgather indices and values, add them up in rank order."""
        p = comm.size
        count = x.size  # 0 too: the header still goes out (Note [call headers])
        k = self.k(count)
        wd = work_dtype(x.dtype)
        vd = x.dtype.newbyteorder("=")  # the wire's: native order (Note [byte order])
        acc = x.reshape(-1).astype(wd)
        with np.errstate(over="ignore", invalid="ignore"):  # Note [non-finite residuals]
            if self.error_feedback:
                residual = self._state(comm, key, x)
                if residual is not None:
                    acc += residual.reshape(-1)  # kept in x's shape (contiguous: a view)
            idx = select_topk(acc, k)
            vals = acc[idx].astype(vd)
            if self.error_feedback:
                acc[idx] -= vals.astype(wd)  # what the wire lost in x's dtype stays too
                acc[~np.isfinite(acc)] = 0

        index_dtype = np.dtype(np.uint32) if count <= 1 << 32 else np.dtype(np.uint64)
        h = HEADER_BYTES  # the call's header first (Note [call headers] in ...compression.base)
        ib = k * index_dtype.itemsize
        mine = np.empty(h + ib + k * vd.itemsize, np.uint8)
        mine[:h] = call_header(x, average)
        mine[h : h + ib] = idx.astype(index_dtype).view(np.uint8)
        mine[h + ib :] = vals.view(np.uint8)
        rows = comm.allgather(mine, timeout=timeout)
        check_headers(rows, comm, self.name)
        if self.error_feedback:  # kept once the call has gone through: a failed one changes nothing
            self._store(comm, key, x, acc.reshape(x.shape))

        out = np.zeros(count, wd)
        with np.errstate(over="ignore", invalid="ignore"):
            for q in range(p):  # rank order: the same additions on every rank
                row = rows[q, h:]
                i = row[:ib].copy().view(index_dtype)
                v = row[ib:].copy().view(vd)
                out[i] += v  # a rank's indices are distinct, so no update is lost
            if average:
                out /= np.asarray(p, wd)  # before the cast: a mean x's dtype holds stays finite
            result = out.astype(x.dtype)
        return result.reshape(x.shape)
