"""Tensors and reduce ops as plait takes them: the checks at the torch edge.

A CPU tensor is handed to plait as a numpy array that shares its memory
(``plait._tensor.as_array``, which leaves the tensor resizable: Note [arrays
over a tensor's memory] there), so results land in the tensor without a copy.
A tensor on another device (CUDA) is handed over as a host copy, and an
output one is written back once the call has succeeded: each call collects
its outputs off the CPU in a list (``back``) that its work's finish step
writes back (``plait.torch._staging``, Note [tensors on a GPU]).
Everything plait cannot serve is refused here, before any byte moves, with an
error that names the call, the argument and what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

import plait
from plait._tensor import as_array
from plait.errors import UnsupportedError
from plait.runtime.work import MAX_TIMEOUT
from plait.torch._staging import Staged, host_copy, host_output

__all__ = [
    "OPS",
    "array",
    "check_one",
    "check_peer",
    "check_root",
    "check_tag",
    "copy_blocks",
    "copy_rows",
    "input_arrays",
    "no_overlap",
    "output_array",
    "output_blocks",
    "output_targets",
    "plait_op",
    "rank_chunks",
    "reshaped_out",
    "row_blocks",
    "same_dtype",
    "seconds",
    "split_sizes",
    "stack_inputs",
    "stacked",
]

_T = TypeVar("_T")
#: The largest tag the backend passes on (plait's user tags are 31 bits).
_MAX_TAG = (1 << 31) - 1

# torch's stub declares RedOpType as an enum without members (SUM, ... exist at run time)
_RedOp: Any = dist.ReduceOp.RedOpType

#: torch's reduce ops and the plait op each one runs as.
OPS: dict[Any, plait.Op] = {
    _RedOp.SUM: plait.SUM,
    _RedOp.PRODUCT: plait.PROD,
    _RedOp.MIN: plait.MIN,
    _RedOp.MAX: plait.MAX,
    _RedOp.BAND: plait.BAND,
    _RedOp.BOR: plait.BOR,
    _RedOp.BXOR: plait.BXOR,
    _RedOp.AVG: plait.AVG,
}


def plait_op(op: Any, call: str) -> plait.Op:
    """The plait op for torch's ``ReduceOp`` (an options object's ``reduceOp``).

    Raises:
        UnsupportedError: PREMUL_SUM (an NCCL-only op) or anything else plait lacks.
    """
    kind = getattr(op, "op", op)
    try:
        return OPS[kind]
    except (KeyError, TypeError):
        pass
    name = getattr(kind, "name", repr(kind))
    raise UnsupportedError(
        f"{call}: the plait backend has no reduce op {name}; it supports "
        + ", ".join(k.name for k in OPS)
    )


def check_one(tensors: Sequence[_T], call: str, what: str = "tensors") -> _T:
    """The single tensor of a per-process tensor list (plait runs one tensor per process)."""
    if len(tensors) != 1:
        raise UnsupportedError(
            f"{call}: the plait backend takes exactly one tensor per process; got "
            f"{len(tensors)} in {what}"
        )
    return tensors[0]


def array(t: Any, call: str, what: str) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (no copy), after checking plait can serve it.

    A tensor off the CPU: a host copy of it, taken now (Note [tensors on a
    GPU] in ``plait.torch._staging``).

    Raises:
        TypeError: not a tensor, or a dtype plait cannot move.
        UnsupportedError: a meta tensor, or sparse, quantized or conjugated.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{call}: {what} must be a torch.Tensor; got {type(t).__name__}")
    if not t.is_cpu:
        return host_copy(t, f"{call}: {what}")
    return as_array(t, f"{call}: {what}", refuse=UnsupportedError)


def output_array(
    t: Any, call: str, what: str, back: list[Staged], contents: bool = True
) -> np.ndarray:
    """Like :func:`array`, for a tensor plait writes into: it must not overlap itself.

    A tensor off the CPU gets a host buffer, recorded in ``back`` for the
    call's work to write back once the call has succeeded; ``contents``
    False: the call writes all of it and reads none, so the tensor's
    contents are not copied to the host.
    """
    if isinstance(t, torch.Tensor) and not t.is_cpu:
        return host_output(t, f"{call}: {what}", back, contents)
    return no_overlap(array(t, call, what), call, what)


def no_overlap(a: np.ndarray, call: str, what: str) -> np.ndarray:
    """``a``, refused where its elements overlap (stride 0, as from ``expand()``): results
    cannot be written into it. ``broadcast`` and ``reduce`` ask it of the tensor of every
    rank, those that only read it too, so that all refuse alike before anything is sent
    (where one rank refused and the others went on, the group broke)."""
    # an empty tensor has no memory to overlap (numpy may give it zero strides)
    if a.size and any(step == 0 and n > 1 for step, n in zip(a.strides, a.shape, strict=True)):
        raise UnsupportedError(
            f"{call}: {what} has overlapping memory (stride 0, as from expand()); results "
            "cannot be written into it: pass a tensor with its own memory (.clone())"
        )
    return a


def reshaped_out(a: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, Callable[[], None]]:
    """An array of ``shape`` for plait to write into that ends up in ``a``.

    A contiguous ``a`` is reshaped in place (a view: plait writes straight into
    it) and a strided one of the right shape is passed as is (plait stages it);
    otherwise plait writes into a scratch array that the returned function
    copies into ``a`` once the call has succeeded.
    """
    if a.shape == shape or a.flags.c_contiguous:
        return a.reshape(shape), _nothing
    scratch = np.empty(shape, a.dtype)

    def copy_back() -> None:
        a[...] = scratch.reshape(a.shape)

    return scratch, copy_back


def _nothing() -> None:
    return None


def seconds(timeout: Any) -> float | None:
    """A torch timeout (a timedelta; zero or negative means unset) in seconds, or None; at
    most plait's :data:`~plait.runtime.work.MAX_TIMEOUT` (``timedelta.max`` is 8.6e13 s)."""
    if timeout is None:
        return None
    total = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return min(total, MAX_TIMEOUT) if total > 0 else None


# -- the arguments of the process group's calls --------------------------------------------
def check_root(root: int, size: int, c: str) -> int:
    """``root`` (an options object's ``rootRank``) as a rank of a group of ``size``."""
    if not 0 <= root < size:
        raise ValueError(f"{c}: root {root} is out of range for group size {size}")
    return int(root)


def check_peer(peer: int, rank: int, size: int, c: str, what: str) -> int:
    """``peer`` (the argument ``what``: ``"dst"`` or ``"src"``) as another rank of the group."""
    if not 0 <= peer < size or peer == rank:
        raise ValueError(
            f"rank {rank}: {c}: {what}={peer} must be another rank of the group (0..{size - 1})"
        )
    return int(peer)


def check_tag(tag: int, c: str) -> int:
    """A point-to-point ``tag`` in the range plait's tags have."""
    if not 0 <= tag <= _MAX_TAG:
        raise ValueError(f"{c}: tag {tag} is out of range 0..{_MAX_TAG} for the plait backend")
    return int(tag)


def same_dtype(a: np.ndarray, b: np.ndarray, c: str) -> None:
    """An input and an output of one dtype (plait converts nothing)."""
    if a.dtype != b.dtype:
        raise TypeError(f"{c}: input and output dtypes differ: {a.dtype} and {b.dtype}")


def split_sizes(size: int, splits: list[int], rows: int, c: str, what: str) -> list[int]:
    """The rows for each of ``size`` ranks: ``splits`` checked, or equal blocks if empty."""
    if not splits:
        if rows % size:
            raise ValueError(
                f"{c}: {what} has {rows} rows, not a multiple of world size {size}; pass "
                f"{what}_split_sizes"
            )
        return [rows // size] * size
    sizes = [int(s) for s in splits]
    if len(sizes) != size or min(sizes) < 0 or sum(sizes) != rows:
        raise ValueError(
            f"{c}: {what}_split_sizes {sizes} must be {size} non-negative sizes that add "
            f"up to dim 0 of the {what} ({rows})"
        )
    return sizes


def output_targets(
    size: int,
    outs: Sequence[torch.Tensor],
    xa: np.ndarray,
    c: str,
    what: str,
    back: list[Staged],
) -> list[np.ndarray]:
    """The ``size`` output tensors of a list (``what``) as arrays, each like the input ``xa``.

    Those off the CPU are recorded in ``back`` (see :func:`output_array`).
    """
    targets = output_blocks(size, outs, xa, None, c, what, back)
    for j, o in enumerate(targets):
        if o.size != xa.size:
            raise ValueError(
                f"{c}: {what}[{j}] is {o.dtype} with {o.size} elements; expected "
                f"{xa.dtype} with {xa.size}, like the input"
            )
    return targets


def output_blocks(
    size: int,
    outs: Sequence[torch.Tensor],
    xa: np.ndarray,
    rank: int | None,
    c: str,
    what: str,
    back: list[Staged],
) -> list[np.ndarray]:
    """The ``size`` output tensors of a list (``what``) as arrays of ``xa``'s dtype.

    Their sizes may differ (torch's uneven ``all_gather``), except that the
    block of ``rank`` (when given) is this rank's own and so has the input's.
    The call fills each of them: those off the CPU get host buffers,
    recorded in ``back`` (see :func:`output_array`).
    """
    if len(outs) != size:
        raise ValueError(f"{c}: {what} has {len(outs)} tensors; expected world size {size}")
    targets = [output_array(o, c, f"{what}[{j}]", back, contents=False) for j, o in enumerate(outs)]
    for j, o in enumerate(targets):
        if o.dtype != xa.dtype:
            raise ValueError(f"{c}: {what}[{j}] is {o.dtype}; expected {xa.dtype}, like the input")
        if j == rank and o.size != xa.size:
            raise ValueError(
                f"{c}: {what}[{j}] has {o.size} elements; expected {xa.size}, like the "
                f"input: rank {rank}'s own tensor goes there"
            )
    return targets


def input_arrays(
    size: int, inputs: Sequence[torch.Tensor], like: np.ndarray, c: str, what: str
) -> list[np.ndarray]:
    """The ``size`` input tensors of a list (``what``) as arrays of ``like``'s dtype."""
    if len(inputs) != size:
        raise ValueError(f"{c}: {what} has {len(inputs)} tensors; expected world size {size}")
    arrays = [array(t, c, f"{what}[{j}]") for j, t in enumerate(inputs)]
    for j, a in enumerate(arrays):
        if a.dtype != like.dtype:
            raise TypeError(
                f"{c}: {what}[{j}] is {a.dtype}; expected {like.dtype}, like the output"
            )
    return arrays


def stack_inputs(
    size: int, inputs: Sequence[torch.Tensor], like: np.ndarray, c: str, what: str
) -> np.ndarray:
    """The ``size`` input tensors of a list (``what``), each like ``like``, as one array."""
    return stacked(input_arrays(size, inputs, like, c, what), like, c, what)


def stacked(arrays: Sequence[np.ndarray], like: np.ndarray, c: str, what: str) -> np.ndarray:
    """``arrays``, each with as many elements as ``like``, as one array of ``like``'s rows."""
    out = np.empty((len(arrays), *like.shape), like.dtype)
    for j, a in enumerate(arrays):
        if a.size != like.size:
            raise ValueError(
                f"{c}: {what}[{j}] is {a.dtype} with {a.size} elements; expected "
                f"{like.dtype} with {like.size}, like the output"
            )
        out[j] = a.reshape(like.shape)
    return out


def row_blocks(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of consecutive blocks of ``sizes`` rows."""
    ends = np.cumsum(sizes, dtype=np.int64).tolist()
    return [(end - n, end) for n, end in zip(sizes, ends, strict=True)]


def copy_blocks(flat: np.ndarray, targets: list[np.ndarray]) -> Callable[[], None]:
    """A finish step that copies consecutive blocks of 1-D ``flat`` into ``targets``."""

    def finish() -> None:
        for (start, end), dst in zip(row_blocks([t.size for t in targets]), targets, strict=True):
            dst[...] = flat[start:end].reshape(dst.shape)

    return finish


def copy_rows(buf: np.ndarray, targets: list[np.ndarray]) -> Callable[[], None]:
    """A finish step that copies row j of ``buf`` into ``targets[j]``."""

    def finish() -> None:
        for row, dst in zip(buf, targets, strict=True):
            dst[...] = row.reshape(dst.shape)

    return finish


def rank_chunks(output: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Each rank's chunk of a gathered ``output`` (views): gloo's future value for the call.

    gloo runs ``all_gather_into_tensor`` as an all_gather into
    ``output.chunk(size)``, and its future holds those chunks; so do this
    backend's. An output whose first dimension does not split into ``size``
    (gloo refuses those shapes) is given whole, as the one tensor.
    """
    if output.dim() == 0 or output.shape[0] % size:
        return [output]
    return list(output.chunk(size))
