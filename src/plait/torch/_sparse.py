"""Sparse COO all-reduce: every rank's indices and values gathered, then coalesced.

Note [sparse all_reduce]
    gloo all-reduces sparse COO tensors, and so does the plait backend, in
    three steps:

    1. Each rank coalesces its own tensor (duplicate indices summed, as
       ``to_dense`` would) and all ranks allgather a header of five int64:
       the number of non-zeros, and a digest each of the sparse dimensions,
       the dense dimensions, the shape and the dtype. Every rank checks every
       rank's header, so ranks whose tensors disagree raise the same
       ValueError on every rank, before any data moves.
    2. One ``allgatherv`` of bytes moves each rank's (index, value) rows at
       their own size: ``nnz × (8·sparse_dim + itemsize·dense_numel)`` bytes
       per rank, no padding. A rank with no non-zeros sends nothing.
    3. Every rank sums the gathered rows with numpy, alike on every rank: a
       stable sort by index keeps the rows of one index in rank order (at
       most one per rank, since each rank's rows are coalesced), and they
       are added in that order, ``((x0 + x1) + x2) + ...``, in at most
       size - 1 vectorised rounds. The same bytes in, the same code: the
       same bits out on every rank. The result is the coalesced sum, equal
       to the dense sum in rank order; for floating point on three or more
       ranks a dense allreduce may round differently, since its algorithm
       picks its own order of additions.

    Only SUM (and AVG, on floating point: the sum divided by the size) has
    a meaning for sparse tensors: a MIN or MAX over the implicit zeros is
    not what anyone means, and gloo refuses them too.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import plait
from plait._tensor import as_array
from plait.errors import CommError, CommTimeout, UnsupportedError
from plait.torch._convert import seconds
from plait.torch._work import PlaitWork, timed_out

if TYPE_CHECKING:
    from plait.torch._backend import ProcessGroupPlait

__all__ = [
    "Header",
    "Local",
    "allreduce",
    "check_headers",
    "local_part",
    "reduce_rows",
    "to_tensor",
]

#: Entries of the header each rank allgathers (all int64).
HEADER = 5
_INDEX = np.dtype(np.int64)


def _digest(text: str) -> int:
    return zlib.crc32(text.encode())


@dataclass(frozen=True)
class Local:
    """One rank's coalesced tensor, ready to send.

    Attributes:
        shape: the tensor's shape.
        sparse_dim: how many leading dimensions are sparse.
        values_dtype: numpy dtype of the values.
        row_shape: the shape of one value (the dense dimensions).
        rows: ``nnz`` rows of ``8·sparse_dim + itemsize·dense_numel`` bytes
            (the row's indices, then its value), as a flat uint8 array.
        nnz: the number of rows.
        header: the five int64 this rank allgathers.
    """

    shape: tuple[int, ...]
    sparse_dim: int
    values_dtype: np.dtype
    row_shape: tuple[int, ...]
    rows: np.ndarray
    nnz: int
    header: np.ndarray

    @property
    def row_bytes(self) -> int:
        """Bytes of one (index, value) row."""
        return int(
            _INDEX.itemsize * self.sparse_dim
            + self.values_dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        )


Header = np.ndarray


def local_part(t: torch.Tensor, call: str) -> Local:
    """This rank's sparse COO tensor, coalesced and packed into rows of bytes.

    Raises:
        UnsupportedError: not on the CPU, or a values dtype plait cannot move.
    """
    if t.device.type != "cpu":
        # dense tensors on a GPU are staged through the host (plait.torch._staging); sparse
        # ones are not: coalescing and the sum run here, on the host, in numpy
        raise UnsupportedError(
            f"{call}: the sparse tensor is on {t.device}; the plait backend all-reduces "
            "sparse tensors on the CPU only: pass t.cpu() (and copy the result back), or a "
            "dense tensor (.to_dense()), which is staged through the host"
        )
    c = t.detach().coalesce()
    indices = as_array(c.indices(), f"{call}: indices", refuse=UnsupportedError)
    values = as_array(c.values(), f"{call}: values", refuse=UnsupportedError)
    nnz = int(indices.shape[1])
    sparse_dim = int(c.sparse_dim())
    shape = tuple(int(n) for n in c.shape)
    row_shape = tuple(values.shape[1:])
    per_row = int(np.prod(row_shape, dtype=np.int64))
    idx = np.ascontiguousarray(indices.T, dtype=_INDEX).reshape(nnz, sparse_dim).view(np.uint8)
    val = np.ascontiguousarray(values).reshape(nnz, per_row).view(np.uint8)
    rows = np.concatenate([idx, val], axis=1).reshape(-1)
    header = np.array(
        [
            nnz,
            sparse_dim,
            _digest(repr(row_shape)),
            _digest(repr(shape)),
            _digest(values.dtype.str),
        ],
        dtype=np.int64,
    )
    return Local(shape, sparse_dim, values.dtype, row_shape, rows, nnz, header)


def check_headers(headers: np.ndarray, rank: int, call: str) -> list[int]:
    """The number of rows of each rank, after checking every rank's tensor is like every other's.

    ``headers`` is the allgathered ``(size, 5)`` array: every rank sees the
    same one and so raises the same error.

    Raises:
        ValueError: ranks disagree on the shape, the sparse dimensions or the dtype.
    """
    what = ("the number of sparse dimensions", "the dense dimensions", "the shape", "the dtype")
    for col, name in enumerate(what, start=1):
        column = headers[:, col]
        if np.any(column != column[0]):
            groups: dict[int, list[int]] = {}
            for r, v in enumerate(column.tolist()):
                groups.setdefault(int(v), []).append(r)
            raise ValueError(
                f"rank {rank}: {call}: the ranks' sparse tensors differ in {name}: "
                f"ranks {sorted(groups.values())} agree within each group only"
            )
    return [int(n) for n in headers[:, 0]]


def reduce_rows(
    flat: np.ndarray, counts: list[int], local: Local, mean: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The coalesced sum of every rank's rows: ``(indices (sparse_dim, n), values (n, ...))``.

    ``flat`` holds every rank's rows in rank order (``counts`` rows each).
    See Note [sparse all_reduce] for why every rank gets the same bits.
    """
    total = sum(counts)
    sd = local.sparse_dim
    rows = flat.reshape(total, local.row_bytes)
    index_bytes = _INDEX.itemsize * sd
    idx = np.ascontiguousarray(rows[:, :index_bytes]).view(_INDEX).reshape(total, sd)
    vals = (
        np.ascontiguousarray(rows[:, index_bytes:])
        .view(local.values_dtype)
        .reshape(total, *local.row_shape)
    )
    if total == 0:
        return np.empty((sd, 0), _INDEX), vals
    # lexsort is stable: rows of one index stay in rank order (no linear index: no overflow)
    order = np.lexsort(idx.T[::-1]) if sd else np.arange(total)
    idx, vals = idx[order], vals[order]
    first = np.r_[True, np.any(idx[1:] != idx[:-1], axis=1)]
    starts = np.flatnonzero(first)
    summed = vals[starts].copy()  # each index's lowest rank's value, then the others' added
    segment = np.cumsum(first) - 1
    place = np.arange(total) - starts[segment]  # how many ranks before this row hold its index
    for k in range(1, int(place.max()) + 1):  # at most size - 1 rounds: ((x0 + x1) + x2) ...
        rows = place == k
        summed[segment[rows]] += vals[rows]
    if mean:
        summed = summed / np.asarray(len(counts), dtype=summed.dtype)
    return np.ascontiguousarray(idx[starts].T), np.asarray(summed, dtype=local.values_dtype)


def to_tensor(indices: np.ndarray, values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """The sparse COO tensor of ``like``'s shape and dtype, marked coalesced."""
    values = np.ascontiguousarray(values)
    try:
        vals = torch.from_numpy(values)
    except TypeError:  # bfloat16 travels as ml_dtypes' type: the same bytes
        vals = torch.from_numpy(values.view(f"u{values.dtype.itemsize}")).view(like.dtype)
    return torch.sparse_coo_tensor(
        torch.from_numpy(indices),
        vals,
        like.shape,
        dtype=like.dtype,
        is_coalesced=True,
        check_invariants=False,  # built sorted and unique above
    )


def allreduce(group: ProcessGroupPlait, t: torch.Tensor, op: plait.Op, opts: Any) -> PlaitWork:
    """``dist.all_reduce`` of a sparse COO tensor on ``group`` (Note [sparse all_reduce]).

    The headers are exchanged before this returns, also for
    ``async_op=True``; the rows move on plait's worker then.
    """
    c = "all_reduce"
    if op not in (plait.SUM, plait.AVG):
        raise UnsupportedError(
            f"{c}: a sparse tensor can only be summed (SUM, or AVG on floating point); "
            f"got {op.name}"
        )
    if op is plait.AVG and not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{c}: AVG needs a floating-point tensor; got {t.dtype}")
    comm = group._comm
    local = local_part(t, c)
    timeout = seconds(getattr(opts, "timeout", None))
    try:
        headers = comm.allgather(local.header, timeout=timeout)
    except CommTimeout as exc:
        raise group._named(timed_out(exc, group._describe(c), timeout or comm.timeout))  # noqa: B904
    except CommError as exc:
        raise group._named(exc)  # noqa: B904 - chained by globally_named()
    counts = check_headers(headers, comm.rank, c)
    row = local.row_bytes
    flat = np.empty(sum(counts) * row, np.uint8)
    byte_counts = [n * row for n in counts]

    def finish() -> None:
        indices, values = reduce_rows(flat, counts, local, op is plait.AVG)
        with torch.no_grad():
            t.copy_(to_tensor(indices, values, t))

    return group._run(
        c,
        opts,
        lambda asy, to: comm.allgatherv(
            local.rows, byte_counts, out=flat, timeout=to, async_op=asy
        ),
        [t],
        finish,
    )
