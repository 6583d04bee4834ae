"""The Communicator: every collective as a method, validated at the edge.

Each call follows one recipe: check the arguments and turn them into an
immutable :class:`_Request` (flat contiguous arrays, the chosen algorithm, the
build context), take the next sequence number, then run the schedule now or,
with ``async_op=True``, on the communicator's worker thread. Nothing below the
edge re-checks arguments, and nothing is sent before the checks pass.

Note [in-place and staging]
    ``out=x`` makes OUT the same memory as IN. Algorithms that are correct
    under that aliasing (every allreduce: they copy IN to OUT first and then
    work in OUT) run on it directly; the others get a private copy of the
    input. Non-contiguous inputs are copied into contiguous staging and
    non-contiguous outputs are written back after success, so any strided
    numpy array works, at the price of a copy.

Note [result types]
    A call returns what it was given: ``out`` itself when the caller passed
    ``out=`` (broadcast and recv return ``x`` and ``buf``, which they fill),
    otherwise a new array in the type of ``x``. A torch tensor in gives a
    torch CPU tensor out, made with ``torch.from_numpy`` over the new numpy
    array's memory (no copy); numpy arrays and every other array-like (lists,
    buffer-protocol and DLPack objects) give numpy arrays. torch is never
    imported by plait for this: a tensor can only be passed where torch is
    already loaded, so ``sys.modules`` tells whether an argument can be one,
    and numpy arguments pay nothing for the check.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from plait import _tensor
from plait.algos._registry import AlgorithmSpec, build_schedule, get
from plait.errors import (
    ClosedError,
    CommError,
    CommTimeout,
    InternalError,
    MismatchError,
    UnsupportedError,
)
from plait.group import GroupTransport, child_comm_id, collective_tag, p2p_tag
from plait.ops import AVG, SUM, Op, check_dtype
from plait.runtime.executor import Call, Workspace, execute
from plait.runtime.work import Work, Worker
from plait.schedule.builder import Context, HostLayout
from plait.selection.select import SEGMENT_BYTES, Choice, Settings, choose, settings
from plait.transport.base import Transport

if TYPE_CHECKING:
    from plait.compression.base import Compressor

__all__ = ["DEFAULT_TIMEOUT", "Communicator", "Stats"]

#: Seconds a call may take before it fails with CommTimeout (PLAIT_TIMEOUT overrides).
DEFAULT_TIMEOUT = float(os.environ.get("PLAIT_TIMEOUT", "300"))

_MAX_USER_TAG = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class _Request:
    """A validated call: everything below the API edge trusts it."""

    spec: AlgorithmSpec
    ctx: Context
    op: Op | None
    inp: np.ndarray  # flat, contiguous
    out: np.ndarray  # flat, contiguous; may be the same memory as inp
    writeback: np.ndarray | None  # caller's non-contiguous destination, filled on success
    result: Any  # what the call returns on success
    writes_caller_memory: bool  # a failure leaves caller memory undefined
    average: bool  # divide the reduced elements by size on success
    plan: _Plan  # what depends only on the call's shape, cached
    aliased: bool  # inp and out are the same memory (an in-place call)


@dataclass(frozen=True, slots=True)
class Stats:
    """Payload bytes a rank's transport has moved; subtract two to measure a stretch of work.

    ::

        before = comm.stats()
        comm.allreduce(x)
        sent = (comm.stats() - before).bytes_sent
    """

    bytes_sent: int
    bytes_received: int

    def __sub__(self, other: Stats) -> Stats:
        return Stats(self.bytes_sent - other.bytes_sent, self.bytes_received - other.bytes_received)

    def __add__(self, other: Stats) -> Stats:
        return Stats(self.bytes_sent + other.bytes_sent, self.bytes_received + other.bytes_received)


class _Plan:
    """The parts of a call that depend only on its shape, computed once per shape.

    A training loop or benchmark repeats a few call shapes; caching the
    context, schedule, digest and error-state need keeps per-call work small.
    """

    __slots__ = ("check", "ctx", "guard", "schedule")

    def __init__(self, spec: AlgorithmSpec, ctx: Context, dtype: np.dtype, op: Op | None) -> None:
        self.ctx = ctx
        self.schedule = build_schedule(spec, ctx)
        self.check = _call_digest(spec.name, ctx, dtype, op)
        # numpy warns (an error under -W error) on float overflow or invalid values: silence
        # it only where a reduction can produce one; np.errstate costs about a microsecond.
        self.guard = op is not None and (
            dtype.kind not in "iub" or op.ufunc not in _QUIET_INT_UFUNCS or op.average
        )


#: Ufuncs that never warn on integer or bool arrays (they wrap around silently).
_QUIET_INT_UFUNCS = frozenset(
    (
        np.add,
        np.multiply,
        np.maximum,
        np.minimum,
        np.bitwise_and,
        np.bitwise_or,
        np.bitwise_xor,
        np.logical_and,
        np.logical_or,
        np.logical_xor,
    )
)
#: Call shapes whose plans a communicator keeps (cleared when full).
_PLAN_CACHE = 1024
#: dtypes that passed check_dtype (a handful in any program).
_GOOD_DTYPES: set[np.dtype] = set()


class Communicator:
    """A group of ``size`` ranks that run collectives together.

    Make one with :func:`plait.init`. Use it as a context manager or call
    :meth:`close`. Every collective validates its arguments on entry (a bad
    argument raises ValueError/TypeError before any byte moves), takes
    ``timeout=`` seconds (default: the communicator's) and ``async_op=True``,
    which returns a :class:`plait.Work` instead of the result. A result has the
    type of the input: a torch tensor for a torch tensor, a numpy array for
    anything else, ``out`` itself when given (see Note [result types]).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        timeout: float | None = None,
        hosts: Sequence[str] | None = None,
        _comm_id: int = 0,
        _settings: Settings | None = None,
    ) -> None:
        # What auto follows (PLAIT_ALGO, the rules file, the profile), read once here so
        # that a bad setting fails now, before any collective, and later changes to the
        # environment or the files cannot make this communicator's ranks disagree.
        try:
            self._settings = settings() if _settings is None else _settings
        except ValueError:
            transport.close()
            raise
        self._transport = transport
        self._rank = transport.rank
        self._size = transport.size
        self._hosts = tuple(hosts) if hosts is not None else ("localhost",) * self._size
        if len(self._hosts) != self._size:
            raise ValueError(f"hosts lists {len(self._hosts)} ranks; expected {self._size}")
        self._on_close: list[Callable[[], object]] = []
        # Host layout for host-aware algorithms; None when every rank shares one host.
        layout = HostLayout.from_names(self._hosts)
        self._layout = layout if layout.n_hosts > 1 else None
        self._comm_id = _comm_id
        # PLAIT_DEBUG=detail: compare every call's full signature across ranks first, and log it.
        debug = os.environ.get("PLAIT_DEBUG", "").lower()
        self._detail = debug == "detail"
        # PLAIT_DEBUG=info (or detail): log each choice auto makes, once per call shape.
        self._log_choices = debug in ("info", "detail")
        if self._log_choices:
            _enable_debug_log()
        self._timeout = _check_timeout(timeout, "init") if timeout is not None else DEFAULT_TIMEOUT
        self._seq = 0
        self._closed = False
        self._broken: BaseException | None = None
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._workspaces = threading.local()  # one Workspace per thread that runs calls
        self._plans: dict[tuple[Any, ...], _Plan] = {}  # see _Plan
        self._auto: dict[tuple[str, int, bool], Choice] = {}  # auto's choice per shape
        self._checked: set[tuple[Op, np.dtype]] = set()  # (op, dtype) pairs known to be valid

    # -- identity and lifetime -----------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank, 0 <= rank < size."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._size

    @property
    def host(self) -> str:
        """Name of the host this rank runs on."""
        return self._hosts[self._rank]

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host of every rank, in rank order."""
        return self._hosts

    @property
    def local_rank(self) -> int:
        """Rank among the ranks on this host (in rank order)."""
        return self._hosts[: self._rank].count(self.host)

    @property
    def local_size(self) -> int:
        """Number of ranks on this host."""
        return self._hosts.count(self.host)

    @property
    def cross_rank(self) -> int:
        """Index of this host among the job's hosts (in order of their first rank)."""
        return list(dict.fromkeys(self._hosts)).index(self.host)

    @property
    def cross_size(self) -> int:
        """Number of hosts."""
        return len(set(self._hosts))

    @property
    def timeout(self) -> float:
        """Default timeout of calls, in seconds."""
        return self._timeout

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def close(self) -> None:
        """Finish queued async calls, then release the transport. Idempotent."""
        if self._closed:
            return
        if self._worker is not None:
            self._worker.stop()
        self._closed = True
        self._transport.close()
        for callback in self._on_close:
            callback()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "open"
        return f"<plait.Communicator rank {self._rank} of {self._size}, {state}>"

    def stats(self) -> Stats:
        """Payload bytes this rank has sent and received since its transport was made.

        Counts message payloads (no headers or handshakes). A group from
        :meth:`split` shares its parent's transport and so its counters: they
        include the traffic of the parent and of every group split from it.
        Take differences of two calls to measure one piece of work
        (:class:`Stats` subtracts).

        Raises:
            UnsupportedError: the transport keeps no byte counters.
        """
        t = self._transport
        try:
            return Stats(int(t.bytes_sent), int(t.bytes_received))  # type: ignore[attr-defined]
        except AttributeError:
            raise UnsupportedError(
                f"rank {self._rank}: stats: {type(t).__name__} keeps no byte counters"
            ) from None

    # -- groups ----------------------------------------------------------------------------
    def split(self, color: int | None, key: int = 0, *, timeout: float | None = None) -> Any:
        """Split into sub-communicators, one per ``color``, as ``MPI_Comm_split`` does.

        Every rank must call it. Ranks passing the same non-negative ``color``
        form one group, ordered by ``key`` and then by their rank here; a rank
        passing ``color=None`` joins no group and gets None. A group shares
        this communicator's connections (closing it leaves this one usable)
        and is fully independent: its calls never match calls made here.

        Example with 4 ranks: ``comm.split(comm.rank % 2)`` gives ranks 0 and 2
        a group of size 2 (as its ranks 0 and 1), and ranks 1 and 3 another.
        """
        for what, value in (("color", color), ("key", key)):
            if value is None and what == "color":
                continue
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"rank {self._rank}: split: {what} must be an int; got {value!r}")
        if color is not None and color < 0:
            raise ValueError(f"rank {self._rank}: split: color must be >= 0 or None; got {color}")
        seq = self._seq  # the allgather below takes this sequence number
        mine = np.array([-1 if color is None else int(color), int(key)], np.int64)
        table = self.allgather(mine, timeout=timeout)
        if color is None:
            return None
        members = sorted((int(k), r) for r, (c, k) in enumerate(table.tolist()) if c == color)
        ranks = [r for _, r in members]
        sub = GroupTransport(self._transport, ranks, ranks.index(self._rank))
        return Communicator(
            sub,
            timeout=self._timeout,
            hosts=[self._hosts[r] for r in ranks],
            _comm_id=child_comm_id(self._comm_id, seq, int(color)),
            _settings=self._settings,
        )

    def split_by_host(self, *, timeout: float | None = None) -> Any:
        """The sub-communicator of the ranks on this rank's host, in rank order."""
        return self.split(self.cross_rank, self._rank, timeout=timeout)

    # -- collectives ---------------------------------------------------------------------
    def allreduce(
        self,
        x: Any,
        op: Op = SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
        compression: Compressor | None = None,
    ) -> Any:
        """Reduce ``x`` element-wise over all ranks; every rank gets the result.

        Example with 2 ranks::

            rank 0: x = [1, 2]      rank 1: x = [10, 20]
            comm.allreduce(x)  ->   [11, 22] on both ranks

        Args:
            x: a numpy array (any shape), a torch CPU tensor (bfloat16 too, with
                ml_dtypes), or an object with the buffer protocol, ``__array__``
                or ``__dlpack__``; read in place, without a copy.
            op: a :class:`plait.Op` (``plait.SUM``, ``plait.MAX``, …).
            out: where to write the result (same shape and dtype as x); ``out=x``
                reduces in place. Without it a new array is returned and x is
                never modified.
            algorithm: ``"auto"`` or a name from ``plait.algorithms("allreduce")``.
            timeout: seconds before the call fails with CommTimeout.
            async_op: return a :class:`plait.Work` instead of waiting.
            compression: a :mod:`plait.compression` compressor (fp16, bf16,
                int8, top-k, PowerSGD): fewer bytes on the wire for an
                approximate SUM or AVG of float arrays. The compressor picks
                its own collectives (``algorithm`` must stay "auto").

        Returns:
            The reduced array, identical bit for bit on all ranks: ``out`` if
            given, else a new torch tensor for a tensor ``x`` and a new numpy
            array for anything else.
        """
        if compression is not None:
            return self._allreduce_compressed(x, op, out, algorithm, timeout, async_op, compression)
        c = "allreduce"
        a = self._array(x, "x", c)
        self._check_op(op, a.dtype, c)
        out_arr = self._out(out, a.shape, a.dtype, c)
        choice = self._choose(c, algorithm, a.nbytes, op)
        req = self._request(choice, a.size, a, out_arr, a.shape, op, src=x, dst=out)
        return self._start(req, timeout, async_op)

    def _allreduce_compressed(
        self,
        x: Any,
        op: Op,
        out: Any,
        algorithm: Any,
        timeout: float | None,
        async_op: bool,
        compression: Compressor,
    ) -> Any:
        """``allreduce(compression=...)``: check everything here, then let the compressor run.

        The compressor makes its calls through this communicator's public
        collectives. With ``async_op=True`` it runs on the worker thread, so
        the sequence numbers of its calls are taken now, in call order (the
        compressor says how many it makes), and its calls use them there:
        calls made meanwhile by the caller cannot take their places.
        """
        from plait.compression.base import Compressor, Keyed

        c = "allreduce"
        r = self._rank
        if not isinstance(compression, Compressor):
            raise TypeError(
                f"rank {r}: {c}: compression must be a plait.compression compressor such as "
                f"plait.compression.FP16(); got {compression!r}"
            )
        a = self._array(x, "x", c)
        if a.dtype.kind != "f" or a.dtype.itemsize > 8:
            raise TypeError(
                f"rank {r}: {c}: compression needs float16, float32 or float64 data; got {a.dtype}"
            )
        if op is not SUM and op is not AVG:
            raise ValueError(
                f"rank {r}: {c}: compression supports plait.SUM and plait.AVG; got {op!r}"
            )
        if algorithm != "auto":
            raise ValueError(
                f"rank {r}: {c}: with compression the compressor chooses its collectives; "
                f"leave algorithm='auto' (got {algorithm!r})"
            )
        out_arr = self._out(out, a.shape, a.dtype, c)
        seconds = self._timeout if timeout is None else _check_timeout(timeout, f"rank {r}: {c}")
        if compression.stateful and a is not x and not isinstance(compression, Keyed):
            raise TypeError(
                f"rank {r}: {c}: {compression.name} keeps state per tensor and "
                f"{type(x).__name__} is not a numpy array whose identity can key it; name the "
                "tensor: compression=c.with_key(name)"
            )
        compression.check(a, self)
        average = op is AVG

        def run() -> Any:
            res = compression.allreduce(self, a, average=average, timeout=seconds)
            if out_arr is None:
                return res if a is x else _tensor.like(x, res)
            out_arr[...] = res
            return out  # the caller's object (Note [result types])

        if not async_op:
            self._check_usable(c)
            return run()
        calls = compression.collectives(a, self)
        describe = f"rank {r}: {c} ({compression.name} compression)"
        work = Work(describe)
        if self._detail:
            # PLAIT_DEBUG=detail checks every call with a nested allgather on the calling
            # thread; keep that simple by running the compressed call here.
            try:
                work._finish(run())
            except BaseException as exc:
                work._finish(error=exc)
            return work
        with self._lock:
            self._check_usable(c)
            seqs = list(range(self._seq + calls - 1, self._seq - 1, -1))  # popped from the end
            self._seq += calls
        if self._worker is None:
            self._worker = Worker(f"plait-rank{r}")

        def job() -> None:
            self._workspaces.pinned = seqs
            try:
                work._finish(run())  # numbers left unused are skipped alike on every rank
            except BaseException as exc:
                work._finish(error=exc)
            finally:
                self._workspaces.pinned = None

        self._worker.submit(job)
        return work

    def reduce(
        self,
        x: Any,
        root: int = 0,
        op: Op = SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` element-wise over all ranks onto ``root``.

        Returns the reduced array on ``root`` (``out`` if given) and None
        elsewhere; ``out`` is ignored on other ranks.
        """
        c = "reduce"
        a = self._array(x, "x", c)
        self._check_root(root, c)
        self._check_op(op, a.dtype, c)
        is_root = self._rank == root
        out_arr = self._out(out, a.shape, a.dtype, c) if is_root else None
        choice = self._choose(c, algorithm, a.nbytes, op)
        req = self._request(
            choice, a.size, a, out_arr, a.shape, op, root=root, has_out=is_root, src=x, dst=out
        )
        return self._start(req, timeout, async_op)

    def broadcast(
        self,
        x: Any,
        root: int = 0,
        *,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Copy root's ``x`` into ``x`` on every rank, in place; returns ``x``.

        Every rank passes an array of the same shape and dtype; on ranks other
        than root it must be writeable.
        """
        c = "broadcast"
        a = self._array(x, "x", c)
        self._check_root(root, c)
        if self._rank != root and not a.flags.writeable:
            raise ValueError(f"rank {self._rank}: {c}: x is read-only; it receives root's data")
        choice = self._choose(c, algorithm, a.nbytes, None)
        req = self._request(choice, a.size, None, a, a.shape, None, root=root, result=x)
        return self._start(req, timeout, async_op)

    def reduce_scatter(
        self,
        x: Any,
        op: Op = SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce over ranks, then split: rank r gets rows ``r*k:(r+1)*k`` of the result.

        Axis 0 of ``x`` must have ``size * k`` rows; the result has shape
        ``(k, *x.shape[1:])``.
        """
        c = "reduce_scatter"
        a = self._array(x, "x", c)
        self._check_op(op, a.dtype, c)
        rows = self._split_rows(a.shape, c)
        shape = (rows, *a.shape[1:])
        out_arr = self._out(out, shape, a.dtype, c)
        choice = self._choose(c, algorithm, a.nbytes // self._size, op)
        req = self._request(choice, a.size // self._size, a, out_arr, shape, op, src=x, dst=out)
        return self._start(req, timeout, async_op)

    def allgather(
        self,
        x: Any,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's ``x`` on every rank: shape ``(size, *x.shape)``, rank order."""
        c = "allgather"
        a = self._array(x, "x", c)
        shape = (self._size, *a.shape)
        out_arr = self._out(out, shape, a.dtype, c)
        choice = self._choose(c, algorithm, a.nbytes, None)
        req = self._request(choice, a.size, a, out_arr, shape, None, src=x, dst=out)
        return self._start(req, timeout, async_op)

    def alltoall(
        self,
        x: Any,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Exchange blocks: axis 0 of ``x`` is cut in ``size`` equal parts, part j goes to rank j.

        Returns the parts received, in rank order, with the shape of ``x``.
        """
        c = "alltoall"
        a = self._array(x, "x", c)
        self._split_rows(a.shape, c)
        out_arr = self._out(out, a.shape, a.dtype, c)
        choice = self._choose(c, algorithm, a.nbytes // self._size, None)
        req = self._request(choice, a.size // self._size, a, out_arr, a.shape, None, src=x, dst=out)
        return self._start(req, timeout, async_op)

    def gather(
        self,
        x: Any,
        root: int = 0,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's ``x`` on root: shape ``(size, *x.shape)`` there, None elsewhere."""
        c = "gather"
        a = self._array(x, "x", c)
        self._check_root(root, c)
        shape = (self._size, *a.shape)
        is_root = self._rank == root
        out_arr = self._out(out, shape, a.dtype, c) if is_root else None
        choice = self._choose(c, algorithm, a.nbytes, None)
        req = self._request(
            choice, a.size, a, out_arr, shape, None, root=root, has_out=is_root, src=x, dst=out
        )
        return self._start(req, timeout, async_op)

    def scatter(
        self,
        x: Any,
        root: int = 0,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Split root's ``x`` along axis 0 in ``size`` parts; rank r gets part r.

        On root, axis 0 of ``x`` must have ``size * k`` rows. Other ranks pass
        an array of the same shape and dtype (its contents are not used) or
        ``x=None`` with ``out`` of shape ``(k, *x.shape[1:])``.
        """
        c = "scatter"
        self._check_root(root, c)
        is_root = self._rank == root
        if x is None and not is_root:
            if out is None:
                raise ValueError(
                    f"rank {self._rank}: {c}: pass x (root's shape and dtype) or out= on non-root"
                )
            o = self._array(out, "out", c)
            shape: tuple[int, ...] = tuple(o.shape)
            if not shape:
                raise ValueError(f"rank {self._rank}: {c}: out must have at least one dimension")
            dtype = o.dtype
            check_dtype(dtype)
            a = np.empty(0, dtype)
        else:
            a = self._array(x, "x", c)
            rows = self._split_rows(a.shape, c)
            shape = (rows, *a.shape[1:])
            dtype = a.dtype
        out_arr = self._out(out, shape, dtype, c)
        count = int(np.prod(shape, dtype=np.int64))
        choice = self._choose(c, algorithm, count * dtype.itemsize, None)
        inp = a if is_root else None
        req = self._request(
            choice, count, inp, out_arr, shape, None, root=root, dtype=dtype, src=x, dst=out
        )
        return self._start(req, timeout, async_op)

    def barrier(self, *, timeout: float | None = None, async_op: bool = False) -> Any:
        """Return only once every rank has entered the barrier."""
        c = "barrier"
        choice = self._choose(c, "auto", 0, None)
        empty = np.empty(0, np.uint8)
        req = self._request(choice, 0, empty, None, (0,), None, has_out=False, result=None)
        return self._start(req, timeout, async_op)

    # -- point to point --------------------------------------------------------------------
    def send(self, x: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst``; matched by the ``recv`` on dst with the same tag.

        Messages with the same (source, tag) arrive in the order they were sent.
        """
        a = self._array(x, "x", "send")
        self._check_peer(dst, "send", "dst")
        wire_tag = self._p2p_tag(tag, "send")
        data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self._check_usable("send")
        t = self._transport
        # numpy's stubs give ndarray the buffer protocol (__buffer__) only from Python 3.12 on
        h = t.isend(dst, wire_tag, memoryview(data), _p2p_check(a.dtype))  # type: ignore[arg-type]
        self._wait_p2p(h, "send", dst, tag, timeout, a)

    def recv(self, buf: Any, src: int, tag: int = 0, *, timeout: float | None = None) -> Any:
        """Receive the next message from ``src`` with ``tag`` into ``buf``; returns ``buf``.

        The message must have exactly ``buf``'s size and dtype.
        """
        a = self._array(buf, "buf", "recv")
        if not a.flags.writeable:
            raise ValueError(f"rank {self._rank}: recv: buf is read-only")
        self._check_peer(src, "recv", "src")
        wire_tag = self._p2p_tag(tag, "recv")
        contiguous = a.flags.c_contiguous
        target = a.reshape(-1) if contiguous else np.empty(a.size, a.dtype)
        self._check_usable("recv")
        view = target.view(np.uint8)
        h = self._transport.irecv(
            src,
            wire_tag,
            memoryview(view),  # type: ignore[arg-type]  # ndarray is a Buffer on 3.12+ stubs only
            _p2p_check(a.dtype),
        )
        self._wait_p2p(h, "recv", src, tag, timeout, a)
        if not contiguous:
            a[...] = target.reshape(a.shape)
        return buf

    # -- validation (the API edge) -----------------------------------------------------------
    def _array(self, x: Any, what: str, c: str) -> np.ndarray:
        if isinstance(x, np.ndarray):
            a = x
        elif _tensor.is_tensor(x):
            a = _tensor.as_array(x, f"rank {self._rank}: {c}: {what}")
        elif hasattr(x, "__dlpack__"):
            try:
                a = np.from_dlpack(x)
            except (TypeError, RuntimeError, BufferError, ValueError) as exc:
                raise TypeError(
                    f"rank {self._rank}: {c}: cannot read {what} ({type(x).__name__}) without "
                    f"a copy: {exc}; pass an array in CPU memory, such as a numpy array"
                ) from None
        else:
            try:
                a = np.asarray(x)
            except Exception as exc:
                raise TypeError(
                    f"rank {self._rank}: {c}: {what} must be an array-like; got "
                    f"{type(x).__name__} ({exc})"
                ) from None
        if a.dtype not in _GOOD_DTYPES:
            try:
                check_dtype(a.dtype)
            except TypeError as exc:
                raise TypeError(f"rank {self._rank}: {c}: {what}: {exc}") from None
            _GOOD_DTYPES.add(a.dtype)
        return a

    def _check_op(self, op: Any, dtype: np.dtype, c: str) -> None:
        if (op, dtype) in self._checked:
            return
        if not isinstance(op, Op):
            raise TypeError(
                f"rank {self._rank}: {c}: op must be a plait.Op such as plait.SUM or "
                f"plait.Op(np.logaddexp); got {op!r}"
            )
        try:
            op.check(dtype)
        except TypeError as exc:
            raise TypeError(f"rank {self._rank}: {c}: {exc}") from None
        if len(self._checked) < _PLAN_CACHE:
            self._checked.add((op, dtype))

    def _check_root(self, root: Any, c: str) -> None:
        if isinstance(root, bool) or not isinstance(root, int | np.integer):
            raise TypeError(f"rank {self._rank}: {c}: root must be an int; got {root!r}")
        if not 0 <= root < self._size:
            raise ValueError(
                f"rank {self._rank}: {c}: root {root} is out of range; expected "
                f"0 <= root < {self._size}"
            )

    def _check_peer(self, peer: Any, c: str, what: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int | np.integer):
            raise TypeError(f"rank {self._rank}: {c}: {what} must be an int; got {peer!r}")
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(
                f"rank {self._rank}: {c}: {what}={peer} is invalid; expected another rank in "
                f"0..{self._size - 1}"
            )

    def _p2p_tag(self, tag: Any, c: str) -> int:
        if isinstance(tag, bool) or not isinstance(tag, int | np.integer):
            raise TypeError(f"rank {self._rank}: {c}: tag must be an int; got {tag!r}")
        if not 0 <= tag <= _MAX_USER_TAG:
            raise ValueError(f"rank {self._rank}: {c}: tag {tag} out of range 0..{_MAX_USER_TAG}")
        return p2p_tag(self._comm_id, int(tag))

    def _split_rows(self, shape: tuple[int, ...], c: str) -> int:
        if not shape or shape[0] % self._size:
            raise ValueError(
                f"rank {self._rank}: {c}: axis 0 of x must be a multiple of size {self._size} "
                f"(size*k rows); got shape {shape}"
            )
        return shape[0] // self._size

    def _out(self, out: Any, shape: tuple[int, ...], dtype: np.dtype, c: str) -> np.ndarray | None:
        if out is None:
            return None
        o = out if isinstance(out, np.ndarray) else self._array(out, "out", c)
        if o.dtype != dtype:
            raise TypeError(f"rank {self._rank}: {c}: out has dtype {o.dtype}; expected {dtype}")
        if tuple(o.shape) != tuple(shape):
            raise ValueError(
                f"rank {self._rank}: {c}: out has shape {tuple(o.shape)}; expected {tuple(shape)}"
            )
        if not o.flags.writeable:
            raise ValueError(f"rank {self._rank}: {c}: out is read-only")
        return o

    def _choose(self, c: str, algorithm: Any, nbytes: int, op: Op | None) -> Choice:
        """The algorithm and segment size of a call: auto's (cached per shape) or the caller's."""
        commutative = op.commutative if op is not None else True
        if not isinstance(algorithm, str):
            raise TypeError(f"rank {self._rank}: {c}: algorithm must be a str; got {algorithm!r}")
        if algorithm == "auto":
            key = (c, nbytes, commutative)
            choice = self._auto.get(key)
            if choice is None:
                choice = choose(
                    c,
                    self._size,
                    nbytes,
                    commutative=commutative,
                    hosts=self._layout,
                    config=self._settings,
                )
                if self._log_choices:
                    _log.info(
                        "rank %d: %s of %d bytes on %d ranks: auto chose %s, segment %s (%s)",
                        self._rank,
                        c,
                        nbytes,
                        self._size,
                        choice.name,
                        _bytes(choice.segment_bytes),
                        choice.source,
                    )
                if len(self._auto) >= _PLAN_CACHE:
                    self._auto.clear()
                self._auto[key] = choice
            return choice
        try:
            spec = get(c, algorithm)
        except ValueError as exc:
            raise ValueError(f"rank {self._rank}: {exc}") from None
        if spec.needs_fabric:
            raise UnsupportedError(
                f"rank {self._rank}: {c}: algorithm {algorithm!r} needs switches that reduce in "
                "flight (SHARP/SwitchML); plait's transports connect ranks only. Simulate it "
                "with plait.sim on a network built with aggregation_memory=..., or use "
                "algorithm='auto'"
            )
        if not spec.supports(commutative=commutative):
            raise UnsupportedError(
                f"rank {self._rank}: {c}: algorithm {algorithm!r} needs a commutative op and "
                f"{op!r} is not; use algorithm='auto' or one that keeps rank order"
            )
        return Choice(spec, SEGMENT_BYTES, "caller")

    def _request(
        self,
        choice: Choice,
        count: int,
        inp: np.ndarray | None,
        out: np.ndarray | None,
        shape: tuple[int, ...],
        op: Op | None,
        *,
        root: int = 0,
        has_out: bool = True,
        result: Any = ...,
        dtype: np.dtype | None = None,
        src: Any = None,
        dst: Any = None,
    ) -> _Request:
        """Flatten and stage the arrays (see Note [in-place and staging]).

        ``src`` and ``dst`` are the caller's ``x`` and ``out`` as passed, before
        conversion: they decide what the call returns (Note [result types]),
        unless ``result`` says it.
        """
        dtype = dtype if dtype is not None else (inp.dtype if inp is not None else out.dtype)  # type: ignore[union-attr]
        spec = choice.spec
        c = spec.collective
        segment = choice.segment(dtype.itemsize)
        key = (spec, count, dtype, op, root, segment)
        plan = self._plans.get(key)
        if plan is None:
            ctx = Context(
                c,
                self._rank,
                self._size,
                count,
                dtype.itemsize,
                op.commutative if op is not None else True,
                root,
                segment,
                self._layout,
            )
            if len(self._plans) >= _PLAN_CACHE:
                self._plans.clear()
            plan = self._plans[key] = _Plan(spec, ctx, dtype, op)
        same_array = inp is not None and out is inp and inp.flags.c_contiguous
        flat_in = _flat(inp) if inp is not None else np.empty(0, dtype)
        writeback = None
        caller_out = out is not None
        if not has_out:
            flat_out = np.empty(0, dtype)
        elif out is None:
            new = np.empty(shape, dtype)
            flat_out = new.reshape(-1)
            if result is ...:
                result = new if src is inp else _tensor.like(src, new)
        else:
            if out.flags.c_contiguous:
                flat_out = out.reshape(-1)
            else:
                # Broadcast's root sends from OUT, so its staging starts as a copy.
                flat_out = (
                    np.ascontiguousarray(out).reshape(-1)
                    if c == "broadcast"
                    else np.empty(out.size, dtype)
                )
                writeback = out
            if result is ...:
                result = out if dst is None else dst
        if result is ...:
            result = None
        aliased = False
        if same_array and flat_in.size == flat_out.size:
            aliased = spec.in_place
            if not aliased and flat_in.size:
                flat_in = flat_in.copy()
        elif flat_in.size and flat_out.size and np.may_share_memory(flat_in, flat_out):
            same = flat_in.ctypes.data == flat_out.ctypes.data and flat_in.size == flat_out.size
            aliased = same and spec.in_place
            if not aliased:
                flat_in = flat_in.copy()
        return _Request(
            spec=spec,
            ctx=plan.ctx,
            op=op,
            inp=flat_in,
            out=flat_out,
            writeback=writeback,
            result=result,
            writes_caller_memory=caller_out or c == "broadcast",
            average=op is not None and op.average,
            plan=plan,
            aliased=aliased,
        )

    # -- running ------------------------------------------------------------------------------
    def _check_usable(self, c: str) -> None:
        if self._closed:
            raise ClosedError(f"rank {self._rank}: {c} on a closed communicator")
        if self._broken is not None:
            raise CommError(
                f"rank {self._rank}: {c}: this communicator is unusable after an earlier "
                f"failure ({self._broken}); create a new one"
            )

    def _start(self, req: _Request, timeout: float | None, async_op: bool) -> Any:
        c = req.spec.collective
        seconds = (
            self._timeout if timeout is None else _check_timeout(timeout, f"rank {self._rank}: {c}")
        )
        if self._detail:
            self._verify_same_call(req, seconds)
        # A compressed async allreduce reserved its calls' numbers (see _allreduce_compressed).
        pinned = getattr(self._workspaces, "pinned", None)
        with self._lock:
            if self._closed or self._broken is not None:
                self._check_usable(c)
            if pinned is None:
                seq = self._seq
                self._seq += 1
            elif pinned:
                seq = pinned.pop()
            else:
                raise InternalError(
                    f"rank {self._rank}: {c}: a compressor made more calls than it reserved"
                )
        describe = (c, req.spec.name, seq)  # formatted only when needed
        if self._detail:
            _log.debug("rank %d: %s: %s", self._rank, _describe(describe), _signature(req))
        if not async_op:
            return self._run(req, seq, seconds, describe)
        work = Work(f"rank {self._rank}: {_describe(describe)}")
        if self._worker is None:
            self._worker = Worker(f"plait-rank{self._rank}")

        def job() -> None:
            try:
                work._finish(self._run(req, seq, seconds, describe))
            except BaseException as exc:
                work._finish(error=exc)

        self._worker.submit(job)
        return work

    def _run(self, req: _Request, seq: int, seconds: float, describe: tuple[str, str, int]) -> Any:
        plan = req.plan
        schedule = plan.schedule
        dtype = req.out.dtype
        workspace = getattr(self._workspaces, "ws", None)
        if workspace is None:  # first call on this thread
            workspace = self._workspaces.ws = Workspace()
        tmp = workspace.take(schedule.tmp_count, dtype)
        staging = workspace.take(schedule.staged_count, dtype, schedule.tmp_count)
        op = req.op
        call = Call(
            describe,
            collective_tag(self._comm_id, seq),
            plan.check,
            op.ufunc if op is not None else np.bitwise_or,
            time.monotonic() + seconds,
        )
        if self._broken is not None or self._closed:
            self._check_usable(req.spec.collective)
        buffers = (req.inp, req.out, tmp)
        try:
            if plan.guard:
                with np.errstate(all="ignore"):
                    execute(schedule, buffers, self._transport, call, staging, req.aliased)
                    if req.average and req.out.size:
                        np.divide(req.out, self._size, out=req.out)
            else:
                execute(schedule, buffers, self._transport, call, staging, req.aliased)
        except CommError as exc:
            self._broken = exc
            notes = []
            if isinstance(exc, MismatchError):
                # The transport knows only that the digests differ; this rank knows its own call.
                notes.append(f"this rank called {_signature(req)}")
                if not self._detail:
                    notes.append("set PLAIT_DEBUG=detail to compare every rank's call")
            if req.writes_caller_memory:
                notes.append("the output buffer's contents are undefined")
            if notes:
                raise type(exc)("; ".join([str(exc), *notes])) from exc.__cause__
            raise
        if req.writeback is not None:
            req.writeback[...] = req.out.reshape(req.writeback.shape)
        return req.result

    def _verify_same_call(self, req: _Request, seconds: float) -> None:
        """PLAIT_DEBUG=detail: allgather every rank's call signature and compare them all.

        Costs one small allgather per call; the default check (a digest in every
        message header) costs nothing extra but can only say that calls differ.
        """
        text = _signature(req).encode()[: _SIGNATURE_BYTES - 1]
        mine = np.zeros(_SIGNATURE_BYTES, np.uint8)
        mine[: len(text)] = np.frombuffer(text, np.uint8)
        self._detail = False  # the check itself is not checked
        try:
            table = self.allgather(mine, algorithm="bruck", timeout=seconds)
        finally:
            self._detail = True
        calls: dict[str, list[int]] = {}
        for r, row in enumerate(table):
            calls.setdefault(bytes(row).rstrip(b"\0").decode(errors="replace"), []).append(r)
        if len(calls) > 1:
            detail = "; ".join(f"ranks {ranks}: {sig}" for sig, ranks in calls.items())
            raise MismatchError(f"rank {self._rank}: ranks made different calls: {detail}")

    def _wait_p2p(
        self, handle: Any, c: str, peer: int, tag: int, timeout: float | None, a: np.ndarray
    ) -> None:
        """Wait for a send or receive of ``a``; raise its error with the call named."""
        seconds = (
            self._timeout if timeout is None else _check_timeout(timeout, f"rank {self._rank}: {c}")
        )
        deadline = time.monotonic() + seconds
        t = self._transport
        while not handle.done:
            left = deadline - time.monotonic()
            if left <= 0 or not t.wait_any([handle], left):
                t.cancel(handle)
                raise CommTimeout(
                    f"rank {self._rank}: {c} with rank {peer} (tag {tag}) timed out after "
                    f"{seconds} s; the peer may have died or not made the matching call"
                )
        if handle.error is not None:
            err = handle.error
            mine = ""
            if isinstance(err, MismatchError):  # the check word of a send/recv is its dtype
                mine = f"; this rank's {c}: {a.size} elements of {a.dtype.name}"
            raise type(err)(f"rank {self._rank}: {c} with rank {peer} (tag {tag}): {err}{mine}")


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)


def _check_timeout(timeout: Any, c: str) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{c}: timeout must be a number of seconds; got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"{c}: timeout must be positive; got {timeout}")
    return float(timeout)


def _describe(label: tuple[str, str, int]) -> str:
    return f"{label[0]} ({label[1]}, call #{label[2]})"


def _digest(req: _Request, dtype: np.dtype) -> int:
    """The check word of a call: equal on all ranks exactly when their calls match."""
    return _call_digest(req.spec.name, req.ctx, dtype, req.op)


@functools.lru_cache(maxsize=4096)
def _call_digest(algorithm: str, ctx: Context, dtype: np.dtype, op: Op | None) -> int:
    # Cached per call shape: a hot loop repeats the same few calls.
    key = op.key if op is not None else "-"
    text = f"{ctx.collective}|{algorithm}|{ctx.count}|{dtype.name}|{key}|{ctx.root}|{ctx.segment}"
    return zlib.crc32(text.encode())


_SIGNATURE_BYTES = 160
_log = logging.getLogger("plait")


def _signature(req: _Request) -> str:
    """What a call is, as PLAIT_DEBUG=detail compares it and mismatch errors show it.

    Every field the check word covers (see :func:`_call_digest`). The segment
    is in bytes, formatted as the log of auto's choices formats it (``1 MiB``);
    the schedule counts it in elements.
    """
    ctx = req.ctx
    dtype = req.out.dtype
    op = req.op.name if req.op is not None else "-"
    segment = _bytes(ctx.segment * dtype.itemsize)
    return (
        f"{ctx.collective}(count={ctx.count}, dtype={dtype.name}, op={op}, "
        f"root={ctx.root}, algorithm={req.spec.name}, segment={segment})"
    )


def _bytes(n: int) -> str:
    """``n`` bytes for a log line: 256 KiB, 1 MiB, 100 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _enable_debug_log() -> None:
    """Show plait's debug log on stderr unless the application configured logging."""
    if not _log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("plait %(levelname)s %(message)s"))
        _log.addHandler(handler)
    _log.setLevel(logging.DEBUG)


def _p2p_check(dtype: np.dtype) -> int:
    return zlib.crc32(f"p2p|{dtype.name}".encode())
