"""The rooted list calls of a plait process group: ``gather`` and ``scatter``.

:class:`RootedCalls` is a mixin of
:class:`~plait.torch._backend.ProcessGroupPlait`, which provides the running
recipe (``_run``, Note [sync and async calls] there).

Note [a list only the root sees]
    ``gather_list`` and ``scatter_list`` exist on the root alone, so a wrong
    list (a tensor of another size or dtype, the wrong number of tensors) is
    seen there alone. Refusing it there before anything is sent, as the
    other calls refuse their bad arguments, broke the group: the other ranks
    were already in the collective, met the root's next call instead
    (MismatchError) and every rank's communicator became unusable. So the
    root takes part whatever its list, and the call fails where it must,
    after the collective, with the group left usable:

    - ``gather``: a root whose ``gather_list`` is wrong gathers into the
      scratch buffer every gather uses anyway (nothing extra on valid calls),
      then raises its error; the list is not written. The other ranks'
      calls complete normally (what they sent is dropped). A rank other
      than the root given a non-empty list sends its tensor, then raises.
    - ``scatter``: the others cannot know that the root's list is wrong, and
      must not take a wrong share for theirs. The call runs on plait's
      ``scatterv`` of flat element counts given on the root only: the root
      broadcasts the counts first (one broadcast of ``size`` int64), and a
      rank whose tensor does not hold its count takes part with memory of
      its own and raises ValueError once the call is done (Note [a share
      learned too late] in ``plait._uneven_edge``), reworded here in torch's
      terms. A root whose list is wrong sends every entry that is right
      (its rank gets it, as on a valid call) and, for each wrong one,
      nothing: a count of 0, which its rank's tensor does not hold unless
      empty, so that rank raises; an entry of another dtype is never sent
      as garbage. The root itself takes part with memory of its own, then
      raises its error; its tensor is not written. With ``async_op=True``
      the count broadcast runs on plait's worker, so no rank waits for the
      root in the call itself; the errors come from ``wait()`` and the
      future. A rank other than the root given a non-empty list takes part
      with memory of its own, then raises.

    torch's ``dist.gather`` and ``dist.scatter`` refuse some list errors
    themselves, on the root, before the backend sees the call: a missing
    list, anything but tensors in it, a dtype other than the root's tensor's.
    Those still leave the other ranks in the call, on any backend; the group's
    own methods, called directly, reach this code with them too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from plait.torch._convert import (
    array,
    check_one,
    check_root,
    copy_rows,
    output_array,
    output_targets,
    reshaped_out,
    stack_inputs,
)
from plait.torch._recipe import GroupRecipe
from plait.torch._staging import Staged
from plait.torch._work import PlaitWork

__all__ = ["RootedCalls"]

_C10D = torch._C._distributed_c10d


def _then_raise(error: Exception) -> Callable[[], None]:
    """A finish step that raises ``error``: the call took part, then fails on this rank."""

    def finish() -> None:
        raise error

    return finish


def _fitting(entries: Any, size: int, like: np.ndarray, c: str) -> list[np.ndarray]:
    """Each rank's share of a wrong ``scatter_list``, flat: the entry where it is a tensor
    of ``like``'s dtype and element count, else nothing (no element: its rank then raises,
    unless its own tensor is empty). Entries that are not a list of ``size`` send nothing."""
    none = np.empty(0, like.dtype)
    if not isinstance(entries, Sequence) or len(entries) != size:
        return [none] * size
    shares = []
    for j, t in enumerate(entries):
        try:
            a = array(t, c, f"scatter_list[{j}]")
        except (TypeError, ValueError):
            a = none
        fits = a.dtype == like.dtype and a.size == like.size
        shares.append(a.reshape(-1) if fits else none)
    return shares


class RootedCalls(GroupRecipe):
    """``gather`` and ``scatter`` of a plait process group (a mixin)."""

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> PlaitWork:
        """``dist.gather``: every rank's tensor into root's gather_list, in rank order.

        A wrong ``gather_list`` raises on the root once every rank has taken
        part, the group left usable (Note [a list only the root sees]).
        """
        opts = opts if opts is not None else _C10D.GatherOptions()
        c = "gather"
        x = check_one(input_tensors, c, "input_tensors")
        comm = self._comm
        root = check_root(opts.rootRank, comm.size, c)
        xa = array(x, c, "tensor")
        if root != comm.rank:
            finish = None
            if output_tensors and any(len(o) for o in output_tensors):
                finish = _then_raise(
                    ValueError(f"{c}: gather_list must be empty on ranks other than dst")
                )
            return self._run(
                c, opts, lambda asy, to: comm.gather(xa, root, timeout=to, async_op=asy), [], finish
            )
        buf = np.empty((comm.size, *xa.shape), xa.dtype)
        back: list[Staged] = []
        try:
            outs = check_one(output_tensors, c, "output_tensors")
            targets = output_targets(comm.size, outs, xa, c, "gather_list", back)
        except (TypeError, ValueError) as exc:  # into the scratch buffer, then raise
            return self._run(
                c,
                opts,
                lambda asy, to: comm.gather(xa, root, out=buf, timeout=to, async_op=asy),
                [],
                _then_raise(exc),
            )
        return self._run(
            c,
            opts,
            lambda asy, to: comm.gather(xa, root, out=buf, timeout=to, async_op=asy),
            list(outs),  # the future's value: gather_list, as gloo's (not a list of lists)
            copy_rows(buf, targets),
            back=back,
        )

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> PlaitWork:
        """``dist.scatter``: root's ``scatter_list[r]`` into rank r's tensor.

        Runs on plait's ``scatterv``, so that a wrong ``scatter_list`` raises
        on the root and on each rank whose share is wrong, the group left
        usable (Note [a list only the root sees]).
        """
        opts = opts if opts is not None else _C10D.ScatterOptions()
        c = "scatter"
        out = check_one(output_tensors, c, "output_tensors")
        comm = self._comm
        size = comm.size
        root = check_root(opts.rootRank, size, c)
        back: list[Staged] = []
        oa = output_array(out, c, "tensor", back, contents=False)
        target, finish = reshaped_out(oa, (oa.size,))
        if root != comm.rank:
            if input_tensors and any(len(i) for i in input_tensors):
                error = ValueError(f"{c}: scatter_list must be empty on ranks other than src")
                rows = np.empty(0, oa.dtype)  # root's dtype and row shape; its share lands apart
                return self._run(
                    c,
                    opts,
                    lambda asy, to: comm.scatterv(rows, None, root, timeout=to, async_op=asy),
                    [out],
                    _then_raise(error),
                )
            return self._run(
                c,
                opts,
                lambda asy, to: comm.scatterv(
                    None, None, root, out=target, timeout=to, async_op=asy
                ),
                [out],
                finish,
                self._share_mismatch(c, root, oa),
                back=back,
            )
        try:
            ins = check_one(input_tensors, c, "input_tensors")
            flat = stack_inputs(size, ins, oa, c, "scatter_list").reshape(-1)
        except (TypeError, ValueError) as exc:  # the right entries go out, then raise
            shares = _fitting(input_tensors[0] if len(input_tensors) == 1 else None, size, oa, c)
            x = np.concatenate(shares)
            counts = [a.size for a in shares]
            return self._run(
                c,
                opts,
                lambda asy, to: comm.scatterv(x, counts, root, timeout=to, async_op=asy),
                [out],
                _then_raise(exc),
            )
        even = [oa.size] * size
        return self._run(
            c,
            opts,
            lambda asy, to: comm.scatterv(flat, even, root, out=target, timeout=to, async_op=asy),
            [out],
            finish,
            back=back,
        )

    def _share_mismatch(
        self, c: str, root: int, oa: np.ndarray
    ) -> Callable[[ValueError], ValueError]:
        """The error a rank raises when root's share for it does not fit its tensor.

        See Note [a list only the root sees]: plait's scatterv raises it once
        the call is done, having taken part with memory of its own.
        """
        describe = self._describe(c)
        rank = self._comm.rank

        def reword(exc: ValueError) -> ValueError:
            return ValueError(
                f"{describe}: src's scatter_list[{rank}] does not fit this rank's tensor "
                f"({oa.dtype} with {oa.size} elements): it has another size, or src (rank "
                f"{root}) refused it (src raises an error naming it and sends nothing for "
                "an entry it refuses); this rank took part with memory of its own, so its "
                f"tensor was not written and the group stays usable ({exc})"
            )

        return reword
