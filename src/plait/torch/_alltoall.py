"""The all-to-alls of a plait process group: ``all_to_all_single`` and ``all_to_all``.

:class:`AllToAllCalls` is a mixin of
:class:`~plait.torch._backend.ProcessGroupPlait`, which provides the running
recipe (``_run``, Note [sync and async calls] there). Both calls may move
blocks of different sizes, as ``all_gather`` and ``reduce_scatter`` with
lists may (those stay in ``plait.torch._backend``); how each of the four runs:

Note [uneven collectives]
    torch has uneven forms of four calls, and each runs on plait's uneven
    collective of the same shape, which moves every block at its own size
    (no padding to the largest):

    - ``all_to_all_single`` with split sizes, and ``all_to_all`` with tensors
      of different sizes: ``alltoallv(x, sends, recvs)``. It starts with an
      allgather of every rank's split sizes (2·size int64 per rank; on
      plait's worker with ``async_op=True``, so the call returns at once),
      after which every rank checks every rank's output splits against what
      the others send and all raise the same ValueError, reworded here in
      torch's terms (:class:`~plait.torch._work.Reworded`).
    - ``all_gather`` into a list of tensors of different sizes (gloo refuses
      them): ``allgatherv(x, counts)``, the counts read from the output list.
    - ``reduce_scatter`` of an input list of different sizes:
      ``reduce_scatter(x, op, counts=)``, the counts read from the input list.

    Those two need no exchange: every rank passes the whole list, so knows
    every count; ranks whose lists disagree fail with plait's MismatchError.
    Lists run on flat element counts (any shapes; a list's tensors are copied
    into or out of one buffer), ``all_to_all_single`` on rows (straight from
    and into its tensors). torch's other calls (``all_gather_into_tensor``,
    ``reduce_scatter_tensor``, ``gather``, ``scatter``) require equal sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from plait.torch._convert import (
    array,
    copy_blocks,
    output_array,
    reshaped_out,
    same_dtype,
    split_sizes,
)
from plait.torch._recipe import GroupRecipe
from plait.torch._staging import Staged
from plait.torch._work import PlaitWork

__all__ = ["AllToAllCalls"]

_C10D = torch._C._distributed_c10d


class AllToAllCalls(GroupRecipe):
    """The all-to-alls of a plait process group (a mixin)."""

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> PlaitWork:
        """``dist.all_to_all_single``: dim-0 blocks of the input to each rank, in rank order.

        Equal blocks when no split sizes are given; uneven ones as in Note
        [uneven collectives].
        """
        opts = opts if opts is not None else _C10D.AllToAllOptions()
        c = "all_to_all_single"
        ia = array(input, c, "input")
        back: list[Staged] = []
        oa = output_array(output, c, "output", back, contents=False)
        same_dtype(ia, oa, c)
        size = self._comm.size
        if not output_split_sizes and not input_split_sizes:
            if ia.size != oa.size or not ia.shape or ia.shape[0] % size:
                raise ValueError(
                    f"{c}: without split sizes, dim 0 of the input ({tuple(ia.shape)}) must be "
                    f"a multiple of world size {size} and the output "
                    f"({tuple(oa.shape)}) must have as many elements"
                )
            x = ia.reshape(size, ia.size // size)
            target, finish = reshaped_out(oa, x.shape)
            comm = self._comm
            return self._run(
                c,
                opts,
                lambda asy, to: comm.alltoall(x, out=target, timeout=to, async_op=asy),
                [output],
                finish,
                back=back,
            )
        if ia.ndim == 0 or oa.ndim == 0 or ia.shape[1:] != oa.shape[1:]:
            raise ValueError(
                f"{c}: input {tuple(ia.shape)} and output {tuple(oa.shape)} must agree beyond dim 0"
            )
        sends = split_sizes(size, input_split_sizes, ia.shape[0], c, "input")
        recvs = split_sizes(size, output_split_sizes, oa.shape[0], c, "output")
        comm = self._comm
        return self._run(
            c,
            opts,
            lambda asy, to: comm.alltoallv(ia, sends, recvs, out=oa, timeout=to, async_op=asy),
            [output],
            reword=self._split_mismatch(c, "output_split_sizes", "input_split_sizes"),
            back=back,
        )

    alltoall_base = all_to_all_single

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> PlaitWork:
        """``dist.all_to_all``: ``input_list[j]`` to rank j, into its ``output_list[me]``.

        The tensors may have any sizes; it runs as in Note [uneven collectives]
        (a rank cannot tell on its own that every rank's are equal).
        """
        opts = opts if opts is not None else _C10D.AllToAllOptions()
        c = "all_to_all"
        size = self._comm.size
        for what, ts in (
            ("input_tensor_list", input_tensors),
            ("output_tensor_list", output_tensors),
        ):
            if len(ts) != size:
                raise ValueError(f"{c}: {what} has {len(ts)} tensors; expected world size {size}")
        ins = [array(t, c, f"input_tensor_list[{j}]") for j, t in enumerate(input_tensors)]
        back: list[Staged] = []
        outs = [
            output_array(t, c, f"output_tensor_list[{j}]", back, contents=False)
            for j, t in enumerate(output_tensors)
        ]
        dtypes = {a.dtype for a in ins + outs}
        if len(dtypes) > 1:
            raise TypeError(f"{c}: all tensors must have one dtype; got {sorted(map(str, dtypes))}")
        flat = np.concatenate([a.reshape(-1) for a in ins])
        sends, recvs = [a.size for a in ins], [a.size for a in outs]
        got = np.empty(sum(recvs), flat.dtype)
        comm = self._comm
        return self._run(
            c,
            opts,
            lambda asy, to: comm.alltoallv(flat, sends, recvs, out=got, timeout=to, async_op=asy),
            output_tensors,
            copy_blocks(got, outs),
            self._split_mismatch(c, "output_tensor_list", "input_tensor_list"),
            back=back,
        )

    def _split_mismatch(self, c: str, recv: str, send: str) -> Callable[[ValueError], ValueError]:
        """The error each rank raises when the ranks' split sizes disagree.

        See Note [uneven collectives].

        plait's alltoallv compares every rank's ``recv_counts`` (torch's
        ``recv``) with what the others' ``send_counts`` (``send``) send it,
        on every rank alike.
        """
        describe = self._describe(c)

        def reword(exc: ValueError) -> ValueError:
            return ValueError(
                f"{describe}: split sizes disagree between ranks: on each rank, {recv}[j] must "
                f"be the size of what rank j sends it in its {send} ({exc})"
            )

        return reword
