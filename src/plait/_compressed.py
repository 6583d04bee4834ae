"""``allreduce(compression=...)``: the contract a compressor meets, its checks, and its run.

The compressors (:mod:`plait.compression`) sit a layer above the communicator
and make their calls through its public collectives; the communicator knows
them only by the :class:`Compression` contract defined here.
:func:`allreduce_compressed` checks a compressed call at the API edge and runs
its compressor, on the calling thread or the call runner's worker.

Note [compressed calls in order]
    A compressor's state (top-k's residual, PowerSGD's ``Q`` and error, the
    generators of stochastic rounding and of PowerSGD without warm start)
    must be read and written in call order: each call starts from what the
    one before it left. An ``async_op=True`` compressed call runs on the
    call runner's worker, in the order of submission; a blocking one ran on
    the calling thread at once, so while an asynchronous call was still
    queued, the blocking call read the state first and the earlier call
    then overwrote what it stored. Top-k's error feedback lost or counted
    twice what it had not sent, and PowerSGD's ``Q``, which every rank
    must keep identical, came out different on ranks whose worker was
    quicker or slower. So each call runner's last submitted compressed call
    is kept (weakly, ``_submitted``); a blocking compressed call made while
    it is not done goes to the worker too, behind it, with its sequence
    numbers reserved as an asynchronous call's are, and the caller waits for
    it and gets its result or its error. Where nothing is pending it runs on
    the calling thread as before (with the same bits: ``CallRunner.reserved``
    makes both pick the same algorithms), and a finished call is forgotten,
    so that its result is not kept alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from plait import _arrays, _tensor
from plait._checks import as_array, check_async, check_out
from plait.ops import AVG, SUM, Op
from plait.runtime.work import Work

if TYPE_CHECKING:
    from plait._runner import CallRunner
    from plait.communicator import Communicator

__all__ = ["Compression", "allreduce_compressed", "check_compression"]


@runtime_checkable
class Compression(Protocol):
    """What ``allreduce(compression=c)`` needs of ``c``; each :mod:`plait.compression` class has it.

    Defined here rather than imported from :mod:`plait.compression`: the
    compressors sit a layer above the communicator and call its public
    collectives, so the communicator names only this contract.
    """

    name: str

    @property
    def stateful(self) -> bool:
        """Whether results depend on earlier calls for the same tensor."""
        ...

    @property
    def keyed(self) -> bool:
        """Whether its state is keyed by a name (``c.with_key(name)``), not by array identity."""
        ...

    def check(self, x: np.ndarray, comm: Any, key: Hashable | None = None) -> None:
        """Raise before any byte moves if this call cannot be served."""
        ...

    def collectives(self, x: np.ndarray, comm: Any) -> int:
        """How many collective calls :meth:`allreduce` makes for ``x``."""
        ...

    def allreduce(self, comm: Any, x: np.ndarray, *, average: bool, timeout: float) -> np.ndarray:
        """Compress, exchange through ``comm``'s public collectives, decompress."""
        ...


def allreduce_compressed(
    comm: Communicator,
    runner: CallRunner,
    x: Any,
    op: Op,
    out: Any,
    algorithm: Any,
    timeout: float | None,
    async_op: bool,
    compression: Compression,
) -> Any:
    """``allreduce(compression=...)``: check everything here, then let the compressor run.

    The compressor makes its calls through the communicator's public
    collectives. With ``async_op=True`` it runs on the worker thread, so
    the sequence numbers of its calls are taken now, in call order (the
    compressor says how many it makes), and its calls use them there:
    calls made meanwhile by the caller cannot take their places. A blocking
    call runs on the calling thread, unless an asynchronous one is still
    pending: then it queues behind it (Note [compressed calls in order]).
    """
    c = "allreduce"
    r = comm.rank
    check_compression(compression, f"rank {r}: {c}")
    async_op = check_async(async_op, f"rank {r}: {c}")
    # A subclass that reshapes as ndarray does (a memmap) is the compressor's array itself, so
    # that its identity keys a stateful compressor's state; np.matrix, which does not, and
    # masked arrays go through as_array (Note [array subclasses] in plait._checks).
    kept = isinstance(x, np.ndarray) and not isinstance(x, np.matrix | np.ma.MaskedArray)
    a = x if kept else as_array(x, "x", r, c)
    if a.dtype.kind != "f" or a.dtype.itemsize > 8 or a.dtype.isbuiltin == 2:  # numpy's own
        raise TypeError(
            f"rank {r}: {c}: compression needs float16, float32 or float64 data; got {a.dtype}"
        )
    if op is not SUM and op is not AVG:
        raise ValueError(f"rank {r}: {c}: compression supports plait.SUM and plait.AVG; got {op!r}")
    if algorithm != "auto":
        raise ValueError(
            f"rank {r}: {c}: with compression the compressor chooses its collectives; "
            f"leave algorithm='auto' (got {algorithm!r})"
        )
    out_arr = check_out(out, a.shape, a.dtype, r, c)
    # A JAX or device x's result in its type; a device out's host buffer copied back.
    make = _arrays.finisher(x) if a is not x else None
    back = _arrays.target(out, out_arr) if out_arr is not None and out is not out_arr else None
    seconds = runner.seconds(timeout, c)
    if compression.stateful and a is not x and not compression.keyed:
        raise TypeError(
            f"rank {r}: {c}: {compression.name} keeps state per tensor and "
            f"{type(x).__name__} is not a numpy array whose identity can key it; name the "
            "tensor: compression=c.with_key(name)"
        )
    compression.check(a, comm)
    average = op is AVG

    def run() -> Any:
        res = compression.allreduce(comm, a, average=average, timeout=seconds)
        if out_arr is None:
            if make is not None:
                return make(res)
            return res if a is x else _tensor.like(x, res)
        out_arr[...] = res
        if back is not None:
            back[...] = out_arr
        return out  # the caller's object (Note [result types])

    if not async_op:
        runner.check_usable(c)
        earlier = _submitted.get(runner)
        if earlier is None or earlier.done():
            if earlier is not None and _submitted.get(runner) is earlier:
                del _submitted[runner]
            return runner.compressing(run)
    calls = compression.collectives(a, comm)
    work = Work(f"rank {r}: {c} ({compression.name} compression)")
    if runner.detail and async_op:
        # PLAIT_DEBUG=detail checks every call with a nested allgather on the calling
        # thread; keep that simple by running the compressed call here.
        try:
            work._finish(runner.compressing(run))
        except BaseException as exc:
            work._finish(error=exc)
        return work
    runner.submit_reserved(work, calls, c, run)
    _submitted[runner] = work
    if not async_op:  # behind an earlier asynchronous call (Note [compressed calls in order])
        return work.wait()
    return work


#: The last compressed call each call runner ran on its worker (Note [compressed calls in order]).
_submitted: weakref.WeakKeyDictionary[CallRunner, Work[Any]] = weakref.WeakKeyDictionary()


def check_compression(compression: Any, where: str) -> None:
    """Refuse a ``compression=`` that is not a compressor, naming ``where`` (the call, or the
    Bucketer that will pass it to its buckets' allreduces); a compressor class gets told to
    make one."""
    if isinstance(compression, type) and all(
        hasattr(compression, m) for m in ("check", "collectives", "allreduce")
    ):
        name = compression.__name__
        raise TypeError(
            f"{where}: compression must be a compressor object, not the class {name}; "
            f"make one: compression={name}()"
        )
    if not isinstance(compression, Compression):
        raise TypeError(
            f"{where}: compression must be a plait.compression compressor such as "
            f"plait.compression.FP16(); got {compression!r}"
        )
