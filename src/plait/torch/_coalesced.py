"""Coalesced calls: several tensors, or several calls, run as one plait collective.

torch has two ways of batching collectives, and a backend serves both:

- calls that take several tensors at once (``all_reduce_coalesced``,
  ``all_gather_coalesced``, and the ``*_into_tensor_coalesced`` /
  ``*_tensor_coalesced`` forms its ``_coalescing_manager`` uses): each runs
  as one plait collective over every tensor concatenated, copied back out
  into torch's tensors by the work's finish step (and from there into
  tensors off the CPU: Note [tensors on a GPU] in ``plait.torch._staging``);
- a coalescing block (``_start_coalescing`` … ``_end_coalescing``) around
  ordinary calls: they run as they come, and the block's work waits for
  them all.

:class:`CoalescedCalls` is a mixin of
:class:`~plait.torch._backend.ProcessGroupPlait`, which provides the running
recipe (``_run``, Note [sync and async calls] there); it is kept apart
because these calls share the concatenate-and-copy-back shape and nothing
else in the group depends on them.

Note [one call per dtype]
    torch's coalescing manager and ``funcol.*_coalesced`` hand one
    ``all_gather_into_tensor_coalesced`` or ``reduce_scatter_tensor_coalesced``
    tensors of several dtypes (bfloat16 parameters beside float32 ones),
    which gloo serves. One plait collective moves one dtype, so the tensors
    are grouped by dtype and each group is one collective over its tensors
    concatenated, the groups in the order their dtypes first come in the
    list. Every rank passes tensors of the same dtypes in the same places
    (gloo needs that too), so every rank makes the same collectives in the
    same order; a rank that does not is told by plait's check of each call.
    The call's work waits for all of them and copies every group's results
    out once all have succeeded. Tensors of one dtype are one collective,
    as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import plait
from plait.torch._convert import (
    array,
    copy_blocks,
    output_array,
    plait_op,
    rank_chunks,
    same_dtype,
)
from plait.torch._recipe import GroupRecipe
from plait.torch._staging import Staged
from plait.torch._work import Joined, Notifier, PlaitWork

__all__ = ["CoalescedCalls"]

_C10D = torch._C._distributed_c10d
#: What starts one collective: (async_op, timeout) -> its plait work (async) or None.
Start = Callable[[bool, float | None], Any]


class CoalescedCalls(GroupRecipe):
    """The coalesced calls and the coalescing block of a plait process group (a mixin)."""

    _notifier: Notifier
    _coalescing: list[PlaitWork] | None  # works of an open coalescing block

    if TYPE_CHECKING:  # provided by ProcessGroupPlait

        def _get_backend(self, device: Any) -> Any: ...

    # -- the coalescing block --------------------------------------------------------------
    def _track(self, work: PlaitWork) -> PlaitWork:
        """``work``, also kept for the coalescing block open on this group (if one is)."""
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _start_coalescing(self, device: Any) -> None:
        """Open a coalescing block: every call until :meth:`_end_coalescing` is kept.

        torch's ``_coalescing_manager(group, device)`` brackets its calls with
        these two; the calls themselves run as they come (each is started on
        plait at once, in call order), and the block's work waits for all.
        """
        self._get_backend(device)
        if self._coalescing is not None:
            raise RuntimeError(f"{self._describe('coalescing')}: a block is already open")
        self._coalescing = []

    def _end_coalescing(self, device: Any) -> PlaitWork:
        """Close the coalescing block; a work that completes once all its calls have."""
        self._get_backend(device)
        works, self._coalescing = self._coalescing or [], None
        return PlaitWork(
            self._describe(f"coalesced block of {len(works)} calls"),
            [Joined(works)],
            [],
            notifier=self._notifier,
            timeout=self._comm.timeout,
        )

    # -- calls of several tensors ---------------------------------------------------------
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> PlaitWork:
        """``dist.all_reduce_coalesced``: several tensors of one dtype in one allreduce."""
        opts = opts if opts is not None else _C10D.AllreduceCoalescedOptions()
        c = "all_reduce_coalesced"
        op = plait_op(opts.reduceOp, c)
        back: list[Staged] = []
        arrays = [output_array(t, c, f"tensors[{i}]", back) for i, t in enumerate(tensors)]
        dtypes = {a.dtype for a in arrays}
        if len(dtypes) > 1:
            raise TypeError(f"{c}: all tensors must have one dtype; got {sorted(map(str, dtypes))}")
        flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.empty(0)

        def finish() -> None:
            offset = 0
            for a in arrays:
                a[...] = flat[offset : offset + a.size].reshape(a.shape)
                offset += a.size

        comm = self._comm
        return self._run(
            c,
            opts,
            lambda asy, to: comm.allreduce(flat, op, out=flat, timeout=to, async_op=asy),
            list(tensors),
            finish,
            back=back,
        )

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> PlaitWork:
        """``dist.all_gather_coalesced``: ``output_lists[r][j]`` gets rank r's ``input_list[j]``.

        One allgather (or allgatherv, if the ranks' totals differ) of every
        input concatenated, copied out into the lists afterwards.
        """
        opts = opts if opts is not None else _C10D.AllgatherOptions()
        c = "all_gather_coalesced"
        comm = self._comm
        ins = [array(t, c, f"input_tensor_list[{j}]") for j, t in enumerate(input_list)]
        if len(output_lists) != comm.size:
            raise ValueError(
                f"{c}: output_tensor_lists has {len(output_lists)} lists; expected world size "
                f"{comm.size}"
            )
        back: list[Staged] = []
        outs = [
            [
                output_array(t, c, f"output_tensor_lists[{r}][{j}]", back, contents=False)
                for j, t in enumerate(row)
            ]
            for r, row in enumerate(output_lists)
        ]
        dtypes = {a.dtype for a in ins} | {a.dtype for row in outs for a in row}
        if len(dtypes) > 1:
            raise TypeError(f"{c}: all tensors must have one dtype; got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
        mine = np.concatenate([a.reshape(-1) for a in ins]) if ins else np.empty(0, dtype)
        counts = [sum(a.size for a in row) for row in outs]
        if counts[comm.rank] != mine.size:
            raise ValueError(
                f"{c}: output_tensor_lists[{comm.rank}] holds {counts[comm.rank]} elements and "
                f"input_tensor_list {mine.size}; this rank's inputs go there"
            )
        flat = np.empty(sum(counts), dtype)
        targets = [a for row in outs for a in row]
        return self._run(
            c,
            opts,
            lambda asy, to: comm.allgatherv(mine, counts, out=flat, timeout=to, async_op=asy),
            output_lists,
            copy_blocks(flat, targets),
            back=back,
        )

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> PlaitWork:
        """Several ``all_gather_into_tensor`` calls as one allgather per dtype (torch's
        coalescing paths; Note [one call per dtype]).

        ``outputs[j]`` gets every rank's ``inputs[j]``, in rank order.
        """
        opts = opts if opts is not None else _C10D.AllgatherOptions()
        c = "all_gather_into_tensor_coalesced"
        back: list[Staged] = []
        ins, outs = self._pairs(c, outputs, inputs, back, gather=True)
        size = self._comm.size
        comm = self._comm
        starts: list[Start] = []
        copies: list[Callable[[], None]] = []
        for dtype, group in _by_dtype(ins, np.dtype(np.float64)):
            mine = np.concatenate([ins[j].reshape(-1) for j in group] or [np.empty(0, dtype)])
            buf = np.empty((size, mine.size), dtype)
            starts.append(_allgather(comm, mine, buf))
            copies.append(_gathered(buf, [(ins[j], outs[j]) for j in group]))
        # The future's value is gloo's: rank r's chunk of every output, for each rank r.
        chunks = [rank_chunks(o, size) for o in outputs]
        whole = any(len(row) != size for row in chunks)
        value = list(outputs) if whole else [[row[r] for row in chunks] for r in range(size)]
        return self._run(c, opts, _in_turn(starts), value, _each(copies), back=back)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> PlaitWork:
        """Several ``reduce_scatter_tensor`` calls as one reduce_scatter per dtype (torch's
        coalescing; Note [one call per dtype]).

        Rank r's ``outputs[j]`` gets the reduction of chunk r of ``inputs[j]``.
        """
        opts = opts if opts is not None else _C10D.ReduceScatterOptions()
        c = "reduce_scatter_tensor_coalesced"
        op = plait_op(opts.reduceOp, c)
        back: list[Staged] = []
        ins, outs = self._pairs(c, outputs, inputs, back, gather=False)
        size = self._comm.size
        comm = self._comm
        starts: list[Start] = []
        copies: list[Callable[[], None]] = []
        for dtype, group in _by_dtype(ins, np.dtype(np.float32)):
            pairs = [(ins[j], outs[j]) for j in group]
            width = sum(o.size for _, o in pairs)
            x = np.empty((size, width), dtype)
            offset = 0
            for a, o in pairs:
                x[:, offset : offset + o.size] = a.reshape(size, o.size)
                offset += o.size
            got = np.empty((1, width), dtype)
            starts.append(_reduce_scatter(comm, x, op, got))
            copies.append(_scattered(got, [o for _, o in pairs]))
        return self._run(c, opts, _in_turn(starts), list(outputs), _each(copies), back=back)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _pairs(
        self,
        c: str,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        back: list[Staged],
        *,
        gather: bool,
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The input and output arrays of a coalesced call, each pair checked for size.

        Outputs off the CPU are recorded in ``back`` (``output_array``).
        """
        if len(outputs) != len(inputs):
            raise ValueError(f"{c}: {len(outputs)} outputs for {len(inputs)} inputs")
        size = self._comm.size
        ins = [array(t, c, f"inputs[{j}]") for j, t in enumerate(inputs)]
        outs = [
            output_array(t, c, f"outputs[{j}]", back, contents=False) for j, t in enumerate(outputs)
        ]
        for j, (a, o) in enumerate(zip(ins, outs, strict=True)):
            same_dtype(a, o, c)
            big, small = (o, a) if gather else (a, o)
            if big.size != size * small.size:
                raise ValueError(
                    f"{c}: {'outputs' if gather else 'inputs'}[{j}] has {big.size} elements; "
                    f"expected world size {size} x the {'input' if gather else 'output'}'s "
                    f"{small.size}"
                )
        return ins, outs


def _by_dtype(arrays: list[np.ndarray], default: np.dtype) -> list[tuple[np.dtype, list[int]]]:
    """``arrays``' indexes grouped by dtype, each group in call order and the groups in the
    order their dtypes first come (Note [one call per dtype]); no arrays: one empty group of
    ``default``, so that the call still meets its peers."""
    groups: dict[np.dtype, list[int]] = {}
    for j, a in enumerate(arrays):
        groups.setdefault(a.dtype, []).append(j)
    return list(groups.items()) or [(default, [])]


def _allgather(comm: plait.Communicator, mine: np.ndarray, buf: np.ndarray) -> Start:
    """What starts the allgather of ``mine`` into the rows of ``buf``."""

    def start(asy: bool, timeout: float | None) -> Any:
        return comm.allgather(mine, out=buf, timeout=timeout, async_op=asy)

    return start


def _reduce_scatter(comm: plait.Communicator, x: np.ndarray, op: Any, got: np.ndarray) -> Start:
    """What starts the reduce_scatter of the rows of ``x`` into ``got``."""

    def start(asy: bool, timeout: float | None) -> Any:
        return comm.reduce_scatter(x, op, out=got, timeout=timeout, async_op=asy)

    return start


def _gathered(buf: np.ndarray, pairs: list[tuple[np.ndarray, np.ndarray]]) -> Callable[[], None]:
    """Copy each input's column block of the gathered rows ``buf`` into its output."""

    def copy() -> None:
        offset = 0
        for a, o in pairs:
            o[...] = buf[:, offset : offset + a.size].reshape(o.shape)
            offset += a.size

    return copy


def _scattered(got: np.ndarray, outs: list[np.ndarray]) -> Callable[[], None]:
    """Copy each output's block of the reduced row ``got`` into it."""

    def copy() -> None:
        start = 0
        for o in outs:
            o[...] = got[0, start : start + o.size].reshape(o.shape)
            start += o.size

    return copy


def _each(steps: list[Callable[[], None]]) -> Callable[[], None]:
    """One finish step that runs ``steps`` in order."""

    def finish() -> None:
        for step in steps:
            step()

    return finish


def _in_turn(starts: list[Start]) -> Start:
    """One start that starts ``starts``' collectives in the order given, every rank alike.

    Blocking, each runs to its end before the next; async, each is queued on plait's
    worker, and the pending call returned waits for them all.
    """
    if len(starts) == 1:
        return starts[0]

    def start(asy: bool, timeout: float | None) -> Any:
        works = [s(asy, timeout) for s in starts]
        return _All(works) if asy else None

    return start


class _All:
    """Several of plait's works waited for as one (the collectives of one coalesced call)."""

    __slots__ = ("_works",)

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def done(self) -> bool:
        """Whether every collective has finished (never blocks)."""
        return all(w.done() for w in self._works)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for each in turn; raises the first error once all have ended, or CommTimeout
        after ``timeout`` s.

        A failed collective's error is held until the later ones have ended too: raised
        at once, the later ones still ran, and the caller (which asks :meth:`done` to tell
        an error of the call from its wait's own timeout) reported a timeout of the wait.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        first: BaseException | None = None
        for w in self._works:
            try:
                w.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            except BaseException as exc:
                if not w.done():  # the wait's own timeout (or an interrupt): not the call's
                    raise
                first = exc if first is None else first
        if first is not None:
            raise first
