"""The "plait" process group: torch.distributed's calls, each run by plait.

torch 2.13 lets Python backends in through a subclass of
``torch.distributed.ProcessGroup`` (its C++ ``Backend`` class cannot be
subclassed from Python). ``init_process_group("plait")`` calls
``create_process_group`` (in ``plait.torch._group``), and the
:class:`ProcessGroupPlait` it returns is the group itself. torch calls its
methods by their C++ names and shapes (``allreduce(tensors, opts)``,
``allgather(output_lists, inputs, opts)``, …),
from Python for ``dist.all_reduce`` and friends and from C++ for
DistributedDataParallel; each returns a :class:`~plait.torch.PlaitWork`.

Note [sync and async calls]
    Every collective is handed to plait on the caller's thread, in program
    order, so that all ranks number their calls alike. A blocking call
    (``opts.asyncOp`` false: ``dist.all_reduce(t)``) runs to the end there and
    returns a finished work, with no thread hand-off. An async one
    (``async_op=True``, and every call DDP makes) is started with plait's
    ``async_op=True``; its work waits on plait's :class:`plait.Work`.
    Point-to-point calls are not collectives: they run apart, in
    ``plait.torch._p2p`` (Note [point to point on lanes] there).

The group's calls live in seven modules: this one (lifetime, the running
recipe, the devices, the dense collectives), ``plait.torch._coalesced``
(coalesced calls and the coalescing block), ``plait.torch._alltoall`` (the
all-to-alls, even and uneven), ``plait.torch._rooted`` (``gather`` and
``scatter``, whose lists only the root sees) and ``plait.torch._p2p`` (send
and receive), all four mixed into :class:`ProcessGroupPlait`, ``plait.torch._sparse``
(the all_reduce of a sparse tensor) and ``plait.torch._staging`` (tensors on
a GPU, served through host copies: Note [tensors on a GPU] there).

Note [the group is its own CPU backend]
    torch registers a backend per device type on a ``ProcessGroup``
    (``_register_backend``), but only a C++ ``Backend``, which Python cannot
    subclass in torch 2.13; and a creator that returns a whole
    ``ProcessGroup``, as this backend's does, is used as the group with no
    backend registered. torch's code that looks a backend up by device
    (coalesced collectives, ``barrier`` with a timeout, ``_get_backend``)
    then failed with "No backend type associated with device type cpu". So
    the group answers those questions itself for the device types it is
    registered for, the CPU and CUDA (as gloo's group does):
    ``_device_types`` lists them, ``_get_backend(cpu)`` and
    ``_get_backend(cuda)`` are the group, and it implements the calls
    torch's C++ ``ProcessGroup`` would route to the device's backend. torch
    makes one group for the two (its creator is called once, for the CPU,
    with the store's "cpu/" namespace, as before CUDA was registered).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import plait
from plait.errors import CommError, CommTimeout, UnsupportedError
from plait.runtime.work import MAX_TIMEOUT
from plait.torch import _sparse
from plait.torch._alltoall import AllToAllCalls
from plait.torch._coalesced import CoalescedCalls
from plait.torch._convert import (
    array,
    check_one,
    check_root,
    copy_blocks,
    copy_rows,
    input_arrays,
    no_overlap,
    output_array,
    output_blocks,
    plait_op,
    rank_chunks,
    reshaped_out,
    same_dtype,
    seconds,
    stacked,
)
from plait.torch._monitored import MonitoredBarrier
from plait.torch._p2p import PointToPoint
from plait.torch._rooted import RootedCalls
from plait.torch._staging import Staged, then_write_back
from plait.torch._store import TorchStore
from plait.torch._work import (
    Lanes,
    Notifier,
    PlaitWork,
    Reworded,
    globally_named,
    reworded,
    timed_out,
)

__all__ = ["BACKEND_NAME", "DEVICE_TYPES", "ProcessGroupPlait"]

#: The name torch knows the backend by: ``init_process_group("plait")``.
BACKEND_NAME = "plait"
_C10D = torch._C._distributed_c10d
#: Seconds shutdown() waits for the helper threads to finish what is queued.
_STOP_WAIT = 10.0
#: The device types the backend is registered for (Note [the group is its own CPU backend]);
#: CUDA tensors are staged through the host (Note [tensors on a GPU] in plait.torch._staging).
DEVICE_TYPES = ("cpu", "cuda")
_DEVICES = [torch.device(kind) for kind in DEVICE_TYPES]

Start = Callable[[bool, float | None], Any]


# misc: RootedCalls' gather and scatter take the backend's (tensor lists, options) form, and
# torch's stub declares ProcessGroup's user-facing overloads for the same names
class ProcessGroupPlait(  # type: ignore[misc]
    CoalescedCalls, AllToAllCalls, RootedCalls, PointToPoint, dist.ProcessGroup
):
    """A torch.distributed process group whose calls plait runs, on CPU and CUDA tensors.

    Made by ``dist.init_process_group("plait")`` or ``dist.new_group(...,
    backend="plait")`` after ``import plait.torch``; it can also wrap a
    :class:`plait.Communicator` directly. Tensors off the CPU go through host
    copies (Note [tensors on a GPU] in ``plait.torch._staging``). Calls plait
    cannot serve (meta tensors, sparse tensors but in a CPU all_reduce,
    PREMUL_SUM, several tensors per process) raise
    :class:`plait.UnsupportedError` naming what is wrong, before anything is
    sent.

    Args:
        comm: the communicator that runs the calls; the group owns it and
            closes it on ``shutdown()``.
        global_ranks: the default group's rank of each member (for messages).
        store: the store the ranks met through (torch's, with the group's
            namespace); :meth:`monitored_barrier` meets there. None: no
            monitored barrier.
    """

    def __init__(
        self,
        comm: plait.Communicator,
        global_ranks: Sequence[int] | None = None,
        store: TorchStore | None = None,
    ) -> None:
        # torch's stub lists only the (store, rank, size) form; the binding has (rank, size) too
        super().__init__(comm.rank, comm.size)  # type: ignore[call-arg]
        self._comm = comm
        self._global = list(global_ranks) if global_ranks else list(range(comm.size))
        #: A sub-group's global ranks, named in its errors (globally_named); None: the same.
        self._globals = None if self._global == list(range(comm.size)) else self._global
        self._notifier = Notifier(f"plait-torch-futures-{comm.rank}")
        self._lanes = Lanes(f"plait-torch-lane-{comm.rank}")
        self._lock = threading.Lock()
        self._down = False
        self._group_name = ""
        self._group_desc = ""
        self._calls = 0  # collectives started: torch's sequence number of the group
        self._coalescing: list[PlaitWork] | None = None  # works of an open coalescing block
        self._monitored = MonitoredBarrier(store, comm.rank, comm.size, self._global)

    @property
    def communicator(self) -> plait.Communicator:
        """The plait communicator that runs this group's calls."""
        return self._comm

    # camelCase names and (tensors, opts) shapes below are torch's C++ API, which calls them.
    def getBackendName(self) -> str:
        """The backend's name, ``"plait"``."""
        return BACKEND_NAME

    # torch keeps a group's name in its backends, and this group has none: keep it here.
    def getGroupName(self) -> str:
        """The name torch registered this group under."""
        return self._group_name

    def setGroupName(self, name: str) -> None:
        """Called by torch when it registers the group."""
        self._group_name = name

    def getGroupDesc(self) -> str:
        """torch's description of the group (``default_pg``, …)."""
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        """Called by torch when it registers the group."""
        self._group_desc = desc

    def __repr__(self) -> str:
        return f"<plait.torch.ProcessGroupPlait rank {self._comm.rank} of {self._comm.size}>"

    # -- lifetime ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish queued calls, stop the helper threads, close the communicator."""
        with self._lock:
            if self._down:
                return
            self._down = True
        self._lanes.stop(_STOP_WAIT)
        self._notifier.stop(_STOP_WAIT)
        self._comm.close()

    def abort(self) -> None:
        """Close the communicator now; calls in flight fail."""
        self.shutdown()

    # -- the running recipe ----------------------------------------------------------------
    def _describe(self, call: str) -> str:
        rank = self._comm.rank
        if self._globals is None:
            return f"rank {rank}: {call}"
        return f"rank {rank} (global rank {self._globals[rank]}): {call}"

    def _named(self, exc: BaseException) -> BaseException:
        """plait's error ``exc`` naming this group's ranks by their global ranks too.

        A sub-group's communicator numbers its ranks from 0; torch's caller
        knows them by their rank in the default group (:func:`globally_named`).
        """
        return globally_named(exc, self._globals)

    def _run(
        self,
        call: str,
        opts: Any,
        start: Start,
        outputs: Any,
        finish: Callable[[], None] | None = None,
        reword: Callable[[ValueError], ValueError] | None = None,
        back: list[Staged] | None = None,
    ) -> PlaitWork:
        """Start a collective (Note [sync and async calls]) and return its work.

        ``reword`` turns an argument error that plait finds only once the
        ranks have met into the one torch's caller gets (see :class:`Reworded`).
        ``back``: output tensors off the CPU and their host buffers, written
        back after ``finish`` once the call has succeeded, before the work
        completes (Note [tensors on a GPU] in ``plait.torch._staging``).
        """
        if back:
            finish = then_write_back(finish, back)
        timeout = seconds(getattr(opts, "timeout", None))
        describe = self._describe(call)
        deadline = timeout if timeout is not None else self._comm.timeout
        self._calls += 1
        if not getattr(opts, "asyncOp", True):
            try:
                start(False, timeout)
            except CommTimeout as exc:
                raise self._named(timed_out(exc, describe, deadline))  # noqa: B904 - chained
            except CommError as exc:  # plait's own, UnsupportedError included: not reworded
                raise self._named(exc)  # noqa: B904 - chained by globally_named()
            except ValueError as exc:
                if reword is None:
                    raise
                raise reworded(exc, reword)  # noqa: B904 - chained by reworded()
            if finish is not None:
                finish()
            return self._track(PlaitWork.completed(describe, outputs))
        try:
            work = start(True, timeout)
        except CommError as exc:  # refused at once (a broken communicator)
            raise self._named(exc)  # noqa: B904 - chained by globally_named()
        return self._track(
            PlaitWork(
                describe,
                [work if reword is None else Reworded(work, reword)],
                outputs,
                finish=finish,
                notifier=self._notifier,
                timeout=deadline,
                global_ranks=self._globals,
            )
        )

    # -- the devices (Note [the group is its own CPU backend]) ------------------------------
    @property
    def _device_types(self) -> list[torch.device]:
        """The device types the group serves: the CPU and CUDA."""
        return list(_DEVICES)

    def _get_backend(self, device: Any) -> ProcessGroupPlait:
        """The backend torch looks up for ``device``: this group itself, for the CPU and CUDA.

        Raises:
            RuntimeError: another device type (torch's own error for a device
                without a backend).
        """
        kind = torch.device(device).type
        if kind not in DEVICE_TYPES:
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    # What torch asks of a backend before using one of its optional features.
    supports_coalescing = False
    supports_splitting = False
    supports_shrinking = False
    supports_tensor_alloc = False
    supports_time_estimate = False

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this group has started (torch's sequence number)."""
        return self._calls

    def _set_sequence_number_for_group(self) -> None:
        """Nothing to do: the count starts at zero on every rank of the group."""

    # -- monitored barrier -----------------------------------------------------------------
    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names every rank that did not arrive within ``timeout``.

        See :func:`plait.torch.monitored_barrier` and Note [monitored barrier]
        in ``plait.torch._monitored``.
        """
        if timeout is None:
            self._monitored.wait(self._comm.timeout)
            return
        # unlike a call's timeout, zero here means zero: only ranks already there pass
        total = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
        self._monitored.wait(min(max(total, 0.0), MAX_TIMEOUT))

    # -- reductions ------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PlaitWork:
        """``dist.all_reduce``: reduce the tensor over all ranks, in place."""
        opts = opts if opts is not None else _C10D.AllreduceOptions()
        c = "all_reduce"
        t = check_one(tensors, c)
        op = plait_op(opts.reduceOp, c)
        if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
            return _sparse.allreduce(self, t, op, opts)
        back: list[Staged] = []
        a = output_array(t, c, "tensor", back)
        comm = self._comm
        return self._run(
            c,
            opts,
            lambda asy, to: comm.allreduce(a, op, out=a, timeout=to, async_op=asy),
            [t],
            back=back,
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PlaitWork:
        """``dist.reduce``: the reduction lands in the tensor of rank ``opts.rootRank``."""
        opts = opts if opts is not None else _C10D.ReduceOptions()
        c = "reduce"
        t = check_one(tensors, c)
        op = plait_op(opts.reduceOp, c)
        root = check_root(opts.rootRank, self._comm.size, c)
        is_root = root == self._comm.rank
        back: list[Staged] = []
        a = (
            output_array(t, c, "tensor", back)
            if is_root
            else no_overlap(array(t, c, "tensor"), c, "tensor")  # as the root refuses
        )
        out = a if is_root else None
        comm = self._comm
        return self._run(
            c,
            opts,
            lambda asy, to: comm.reduce(a, root, op, out=out, timeout=to, async_op=asy),
            [t],
            back=back,
        )

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> PlaitWork:
        """``dist.reduce_scatter``: reduce ``input_list[r]`` over ranks into rank r's output.

        The tensors of ``input_list`` may differ in size (Note [uneven collectives] in
        ``plait.torch._alltoall``).
        """
        opts = opts if opts is not None else _C10D.ReduceScatterOptions()
        c = "reduce_scatter"
        out = check_one(output_tensors, c, "output_tensors")
        inputs = check_one(input_tensors, c, "input_tensors")
        op = plait_op(opts.reduceOp, c)
        back: list[Staged] = []
        oa = output_array(out, c, "output", back, contents=False)
        comm = self._comm
        arrays = input_arrays(comm.size, inputs, oa, c, "input_list")
        sizes = [a.size for a in arrays]
        counts: list[int] | None = None  # equal blocks: one row of x per rank
        if all(n == oa.size for n in sizes):
            x = stacked(arrays, oa, c, "input_list")
            target, finish = reshaped_out(oa, (1, *oa.shape))
        elif sizes[comm.rank] != oa.size:
            raise ValueError(
                f"{c}: input_list[{comm.rank}] has {sizes[comm.rank]} elements and the output "
                f"{oa.size}; rank {comm.rank}'s output gets the reduction of "
                f"input_list[{comm.rank}]"
            )
        else:  # Note [uneven collectives] in plait.torch._alltoall
            x, counts = np.concatenate([a.reshape(-1) for a in arrays]), sizes
            target, finish = reshaped_out(oa, (oa.size,))
        return self._run(
            c,
            opts,
            lambda asy, to: comm.reduce_scatter(
                x, op, counts=counts, out=target, timeout=to, async_op=asy
            ),
            [out],
            finish,
            back=back,
        )

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> PlaitWork:
        """``dist.reduce_scatter_tensor``: rank r gets the reduction of chunk r of the input."""
        opts = opts if opts is not None else _C10D.ReduceScatterOptions()
        c = "reduce_scatter_tensor"
        op = plait_op(opts.reduceOp, c)
        back: list[Staged] = []
        oa = output_array(output, c, "output", back, contents=False)
        ia = array(input, c, "input")
        size = self._comm.size
        same_dtype(ia, oa, c)
        if ia.size != size * oa.size:
            raise ValueError(
                f"{c}: input has {ia.size} elements; expected world size {size} x the "
                f"output's {oa.size}"
            )
        x = ia.reshape(size, oa.size)
        target, finish = reshaped_out(oa, (1, oa.size))
        comm = self._comm
        return self._run(
            c,
            opts,
            lambda asy, to: comm.reduce_scatter(x, op, out=target, timeout=to, async_op=asy),
            [output],
            finish,
            back=back,
        )

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # stub: user-facing signature

    # -- data movement -----------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> PlaitWork:
        """``dist.broadcast``: root's tensor copied into the tensor of every rank."""
        opts = opts if opts is not None else _C10D.BroadcastOptions()
        c = "broadcast"
        t = check_one(tensors, c)
        if opts.rootTensor != 0:
            raise UnsupportedError(f"{c}: rootTensor must be 0 (one tensor per process)")
        root = check_root(opts.rootRank, self._comm.size, c)
        back: list[Staged] = []
        if root == self._comm.rank:
            a = no_overlap(array(t, c, "tensor"), c, "tensor")  # as the other ranks refuse
        else:
            a = output_array(t, c, "tensor", back, contents=False)
        comm = self._comm
        return self._run(
            c,
            opts,
            lambda asy, to: comm.broadcast(a, root, timeout=to, async_op=asy),
            [t],
            back=back,
        )

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> PlaitWork:
        """``dist.all_gather``: every rank's tensor into the output list, in rank order.

        The tensors of the list may differ in size (Note [uneven collectives] in
        ``plait.torch._alltoall``).
        """
        opts = opts if opts is not None else _C10D.AllgatherOptions()
        c = "all_gather"
        x = check_one(input_tensors, c, "input_tensors")
        outs = check_one(output_tensors, c, "output_tensors")
        xa = array(x, c, "tensor")
        comm = self._comm
        back: list[Staged] = []
        targets = output_blocks(comm.size, outs, xa, comm.rank, c, "tensor_list", back)
        counts = [t.size for t in targets]
        if any(n != xa.size for n in counts):
            flat = np.empty(sum(counts), xa.dtype)
            mine = xa.reshape(-1)
            return self._run(
                c,
                opts,
                lambda asy, to: comm.allgatherv(mine, counts, out=flat, timeout=to, async_op=asy),
                list(outs),  # the future's value: the output list, as gloo's
                copy_blocks(flat, targets),
                back=back,
            )
        buf = np.empty((comm.size, *xa.shape), xa.dtype)
        return self._run(
            c,
            opts,
            lambda asy, to: comm.allgather(xa, out=buf, timeout=to, async_op=asy),
            list(outs),  # the future's value: the output list, as gloo's (not a list of lists)
            copy_rows(buf, targets),
            back=back,
        )

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> PlaitWork:
        """``dist.all_gather_into_tensor``: rank r's tensor into chunk r of the output."""
        opts = opts if opts is not None else _C10D.AllgatherOptions()
        c = "all_gather_into_tensor"
        xa = array(input, c, "input")
        back: list[Staged] = []
        oa = output_array(output, c, "output", back, contents=False)
        size = self._comm.size
        same_dtype(xa, oa, c)
        if oa.size != size * xa.size:
            raise ValueError(
                f"{c}: output has {oa.size} elements; expected world size {size} x the "
                f"input's {xa.size}"
            )
        target, finish = reshaped_out(oa, (size, *xa.shape))
        comm = self._comm
        return self._run(
            c,
            opts,
            lambda asy, to: comm.allgather(xa, out=target, timeout=to, async_op=asy),
            rank_chunks(output, size),
            finish,
            back=back,
        )

    _allgather_base = all_gather_single

    def barrier(self, opts: Any = None) -> PlaitWork:
        """``dist.barrier``: returns once every rank has entered."""
        opts = opts if opts is not None else _C10D.BarrierOptions()
        comm = self._comm
        return self._run(
            "barrier", opts, lambda asy, to: comm.barrier(timeout=to, async_op=asy), []
        )
