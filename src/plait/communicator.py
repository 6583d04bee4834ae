"""The Communicator: the public face of a group of ranks.

A user's call goes through three rooms, one module each:

- the edge: :class:`Communicator` (this module: identity, lifetime, groups,
  the algorithm choice), point to point from
  :class:`plait._p2p.PointToPointMethods` (MPI's blocking and non-blocking
  sends and receives, wildcards, probes), and the collectives it inherits, in
  three layers of mixins: the even ones from
  :class:`plait._edge.CollectiveMethods`, the uneven ones (per-rank row
  counts) from :class:`plait._uneven_edge.UnevenMethods` and the object ones
  (pickled Python objects, :mod:`plait.objects`) from
  :class:`plait._object_methods.ObjectMethods`; every one checks its
  arguments with :mod:`plait._checks` before anything else happens;
- the request: :mod:`plait._request` turns the checked call into an immutable
  ``Request`` (flat contiguous arrays, the cached plan, in-place handling, the
  value to return) or hands ``compression=`` to the compressor;
- the call runner: :mod:`plait._runner` takes the next sequence number and runs
  the schedule now or, with ``async_op=True``, on the communicator's worker
  thread, and keeps the closed and broken state.

Nothing below the edge re-checks arguments, and nothing is sent before the
checks pass.

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

import logging
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from plait import collectives
from plait._checks import CACHE_LIMIT, check_timeout, debug_level
from plait._compressed import allreduce_compressed
from plait._fork import watch
from plait._object_methods import Lanes, ObjectMethods
from plait._p2p import PointToPointMethods
from plait._request import Stager
from plait._runner import CallRunner
from plait._shortcut import Shortcut
from plait._signature import format_bytes
from plait._uneven_edge import _UNEVEN_AUTO
from plait.algos._registry import get
from plait.diagnostics.stragglers import (
    OWN_CALLS,
    Lateness,
    from_table,
    local_collectives,
    local_row,
    newest_done,
)
from plait.errors import ForkedError, UnsupportedError
from plait.group import (
    GroupTransport,
    claim_comm_id,
    free_candidate,
    reserve_ids,
)
from plait.ops import MIN, Op
from plait.schedule.builder import HostLayout
from plait.selection.select import (
    FULL_WINDOW_BYTES,
    SEGMENT_BYTES,
    Choice,
    Settings,
    choose,
    settings,
)
from plait.transport.base import Transport

if TYPE_CHECKING:
    from plait._compressed import Compression
    from plait._recovery import Agreement, Recovery

__all__ = ["DEFAULT_TIMEOUT", "Communicator", "Stats", "default_timeout"]

_ALLGATHER = collectives.get("allgather")
_ALLREDUCE = collectives.get("allreduce")
#: Window bytes per rank below which ``auto`` goes through messages: a one-sided piece of
#: one element takes up to 2 × size window elements (alltoall's), of up to 32 bytes
#: (clongdouble), and a smaller window (PLAIT_SHM_WINDOW set that low) holds none.
_SMALLEST_WINDOW = 2 * 32

#: Seconds a call may take before it fails with CommTimeout, where neither the call, its
#: communicator nor PLAIT_TIMEOUT says (:func:`default_timeout`).
DEFAULT_TIMEOUT = 300.0


def default_timeout() -> float:
    """PLAIT_TIMEOUT's seconds if it is set, else :data:`DEFAULT_TIMEOUT`.

    Read when a communicator is made, not when plait is imported, so that a bad value is
    refused there with a message that names it (it used to fail ``import plait`` with
    numpy's words, or to time every call out at once where it was negative).

    Raises:
        ValueError: PLAIT_TIMEOUT is not a positive number of seconds.
    """
    value = os.environ.get("PLAIT_TIMEOUT", "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    where = f"PLAIT_TIMEOUT={value!r}"
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{where}: timeout must be a number of seconds, such as 300") from None
    return check_timeout(seconds, where)


@dataclass(frozen=True, slots=True)
class Stats:
    """Payload bytes a rank's transport has moved in messages; subtract two to measure a
    stretch of work.

    ::

        before = comm.stats()
        comm.allreduce(x, algorithm="ring")
        sent = (comm.stats() - before).bytes_sent

    The one-sided calls of one host (the ``arena`` algorithms, which ``auto`` takes there)
    send no messages: ranks read each other's windows, which these counts leave out.
    """

    bytes_sent: int
    bytes_received: int

    def __sub__(self, other: Stats) -> Stats:
        return Stats(self.bytes_sent - other.bytes_sent, self.bytes_received - other.bytes_received)

    def __add__(self, other: Stats) -> Stats:
        return Stats(self.bytes_sent + other.bytes_sent, self.bytes_received + other.bytes_received)


class Communicator(PointToPointMethods, ObjectMethods):
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
        _world_rank: int | None = None,
        _run: str | None = None,
        _members: Sequence[int] | None = None,
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
        # Groups split from it: they share its transport, so they close with it first.
        self._groups: weakref.WeakSet[Communicator] = weakref.WeakSet()
        # abort, agree and shrink over the store plait.init met through (plait._recovery),
        # and where there is none, why (plait.init says which store it met through).
        self._recovery: Recovery | None = None
        self._no_recovery = "made without a store (from a transport object)"
        # Host layout for host-aware algorithms; None when every rank shares one host.
        layout = HostLayout.from_names(self._hosts)
        self._layout = layout if layout.n_hosts > 1 else None
        self._comm_id = _comm_id
        claim_comm_id(transport, _comm_id)  # a split's group takes another (plait.group)
        # PLAIT_DEBUG=detail: compare every call's full signature across ranks first, and log it.
        try:
            debug = debug_level()
        except ValueError:
            transport.close()
            raise
        # PLAIT_DEBUG=info (or detail): log each choice auto makes, once per call shape.
        self._log_choices = debug in ("info", "detail")
        if self._log_choices:
            _enable_debug_log()
        seconds = check_timeout(timeout, "init") if timeout is not None else default_timeout()
        # The rank in the world communicator names this process's timeline file.
        self._world_rank = self._rank if _world_rank is None else _world_rank
        try:  # a bad PLAIT_RECORDER_* setting fails here, as a bad PLAIT_ALGO does above
            self._runner = CallRunner(
                transport, _comm_id, seconds, debug == "detail", self._world_rank
            )
            watch(self._runner, self._rank)  # Note [communicators after fork] in plait._fork
            # dropped without close(): its async worker thread ends (LazyWorker.let_go)
            weakref.finalize(self, self._runner._worker.let_go).atexit = False
        except ValueError:
            transport.close()
            raise
        # Which run of the job this is (plait.init draws it): dumps of a job id used again
        # are told apart by it (Note [runs of a job] in plait.diagnostics.analyze).
        self._run = _run
        # Each rank's rank in the job (the world communicator plait.init made, or the
        # harness's), where known: dumps and timelines name a group's ranks by the job's
        # numbers too. None for a communicator that is not the job's world or of it (a torch
        # group's plait.init, a transport passed in): its ranks say nothing of the job's.
        self._members = None if _members is None else tuple(_members)
        if self._runner.recorder is not None:
            self._runner.recorder.run = _run
            self._runner.recorder.members = self._members
        # The window ranks of one host share (plait.transport.shm.window), if the transport has one.
        window = getattr(transport, "window", None)
        self._window = int(window.capacity) if window is not None else 0
        # Across hosts, each host's ranks may share one (Note [mixed schedules]): the
        # algorithms with host_windows read them; the one-sided ones cannot run.
        self._host_windows = int(getattr(transport, "host_window_bytes", 0))
        window_bytes = self._window or self._host_windows
        self._stage = Stager(self._rank, self._size, self._layout, window_bytes)
        self._plans = self._stage.plans  # the plan cache, by call shape (see plait._request)
        self._auto: dict[tuple[str, int, bool, bool, bool], Choice] = {}  # auto's choice per shape
        self._checked: set[tuple[Op, np.dtype]] = set()  # (op, dtype) pairs known to be valid
        # Repeated simple calls, by everything the checks read (Note [the short path]).
        self._shortcuts: dict[tuple[Any, ...], Shortcut] = {}
        self._barrier = None  # CollectiveMethods._barrier
        self._lanes = Lanes()  # send_object's and recv_object's (plait._object_methods)

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
    def window_bytes(self) -> int:
        """Bytes of the shared window each rank may use per call: the ranks are on one host
        and share memory, so the one-sided ``arena`` algorithms can run; 0 where they cannot
        (several hosts, TCP, ``PLAIT_SHM_WINDOW=0``). The world's is ``PLAIT_SHM_WINDOW``
        (2 MiB by default); a split's group has a window of its own of the parent's
        size, of which 256 KiB is reserved at the split and the rest at the first call
        that needs it (``GROUP_WINDOW_BYTES`` in :mod:`plait.transport.window`), or none
        if some rank could not set it up. ``auto`` runs the one-sided algorithms in a
        window smaller than ``FULL_WINDOW_BYTES`` (2 MiB: pieces of 1 MiB) only for calls
        that fit in it, and not in one below 64 bytes a rank, which holds no piece of some."""
        return self._window

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
        return self._runner.timeout

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._runner.closed

    def close(self) -> None:
        """Finish queued async calls, then release the transport. Idempotent."""
        if self._runner.closed:
            return
        if isinstance(self._runner.broken, ForkedError):  # the parent's, in a forked child
            self._runner.closed = True
            return
        if self._recovery is not None:  # an abort in progress finishes first (plait._recovery)
            self._recovery.closing(self)
        for group in list(self._groups):  # their queued async calls finish first
            group.close()
        self._runner.close()
        for callback in self._on_close:
            callback()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        runner = self._runner
        state = "closed" if runner.closed else "broken" if runner.broken else "open"
        return f"<plait.Communicator rank {self._rank} of {self._size}, {state}>"

    def stats(self) -> Stats:
        """Payload bytes of the messages this rank sent and received since its transport was made.

        Counts message payloads (no headers or handshakes), on every
        transport. Data that moves without a message is not counted: the
        one-sided algorithms of one host (the ``arena`` ones, which ``auto``
        takes there for most calls) read and write the peers' memory in the
        host's shared window directly, so there the counts may not move at
        all; counting them would cost every such call, which takes
        microseconds. ``PLAIT_SHM_WINDOW=0`` or a message algorithm
        (``algorithm="ring"``) counts what would go as messages. A group from
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
    @overload
    def split(self, color: int, key: int = ..., *, timeout: float | None = ...) -> Communicator: ...
    @overload
    def split(self, color: None, key: int = ..., *, timeout: float | None = ...) -> None: ...
    @overload
    def split(
        self, color: int | None, key: int = ..., *, timeout: float | None = ...
    ) -> Communicator | None: ...
    def split(
        self, color: int | None, key: int = 0, *, timeout: float | None = None
    ) -> Communicator | None:
        """Split into sub-communicators, one per ``color``, as ``MPI_Comm_split`` does.

        Every rank must call it. Ranks passing the same non-negative ``color``
        form one group, ordered by ``key`` and then by their rank here; a rank
        passing ``color=None`` joins no group and gets None. A group shares
        this communicator's connections (closing it leaves this one usable;
        closing this one closes it first, after its queued async calls) and is
        fully independent: its calls never match calls made here.

        Example with 4 ranks: ``comm.split(comm.rank % 2)`` gives ranks 0 and 2
        a group of size 2 (as its ranks 0 and 1), and ranks 1 and 3 another.
        """
        for what, value in (("color", color), ("key", key)):
            if value is None and what == "color":
                continue
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"rank {self._rank}: split: {what} must be an int; got {value!r}")
            if not -(1 << 63) <= int(value) < 1 << 63:
                raise ValueError(
                    f"rank {self._rank}: split: {what} must fit in 64 signed bits "
                    f"(-2**63 to 2**63-1); got {value}"
                )
        if color is not None and color < 0:
            raise ValueError(f"rank {self._rank}: split: color must be >= 0 or None; got {color}")
        seq = self._runner.seq  # the allgather below takes this sequence number
        # Each rank's word: which of its color's candidate ids it holds; it reserves the
        # others until the group has chosen (Note [communicator ids] in plait.group).
        with reserve_ids(self._transport, self._comm_id, seq, color) as ids:
            mine = np.array([-1 if color is None else int(color), int(key), ids.word], np.int64)
            table = self._within(_ALLGATHER, mine, "split", timeout)
            if color is None:
                return None
            rows = table.reshape(self._size, 3).tolist()
            members = sorted((int(k), r) for r, (c, k, _) in enumerate(rows) if c == color)
            ranks = [r for _, r in members]
            attempt = free_candidate([rows[r][2] for r in ranks])
            if attempt is None:
                raise UnsupportedError(
                    f"rank {self._rank}: split: the group's ranks have used every id it could "
                    "take on this communicator's connections; make fewer groups (reuse them)"
                )
            comm_id = ids.take(attempt)
        # On one host the group sets up a shared window of its own (Note [split windows]).
        setup = self._runner.timeout if timeout is None else float(timeout)
        sub = GroupTransport(
            self._transport, ranks, ranks.index(self._rank), comm_id=comm_id, timeout=setup
        )
        group = Communicator(
            sub,
            timeout=self._runner.timeout,
            hosts=[self._hosts[r] for r in ranks],
            _comm_id=comm_id,
            _settings=self._settings,
            _world_rank=self._world_rank,
            _run=self._run,
            _members=None if self._members is None else [self._members[r] for r in ranks],
        )
        if self._recovery is not None:  # it shares the connections, so an abort reaches it
            self._recovery.adopt(group)
        self._groups.add(group)
        return group

    def split_by_host(self, *, timeout: float | None = None) -> Communicator:
        """The sub-communicator of the ranks on this rank's host, in rank order."""
        return self.split(self.cross_rank, self._rank, timeout=timeout)

    # -- recovery from a lost rank (plait._recovery, docs/fault-tolerance.md) ---------------
    def abort(self, reason: str = "") -> None:
        """Make every call in flight and every later call fail, on every rank: AbortedError.

        May be called from any thread or a signal handler (it takes no lock).
        The ranks learn of it through the store they met through; it returns
        once every other rank has marked its communicator aborted (within
        milliseconds as a rule, a second at most), so the process may exit
        right after. This communicator (and its split groups, which share its
        connections) is then good only for :meth:`agree`, :meth:`shrink` and
        :meth:`close`. Without a store (a communicator made from a transport)
        only this rank's calls fail, and its peers see it as lost. ``reason``
        goes into every rank's error. Note [abort] in :mod:`plait._recovery`.
        """
        from plait._recovery import abort

        abort(self, reason)

    def agree(self, flag: int = 1, *, timeout: float | None = None) -> Agreement:
        """Agree with the surviving ranks on the AND of ``flag`` and on who survives.

        Every surviving rank must call it (as many times as the others); it
        completes even when ranks fail before or during it: a rank whose
        process is gone, or whose heartbeat stopped, is left out (Note [agree]
        in :mod:`plait._recovery`). Works on a broken or aborted communicator;
        it goes through the store, not the connections.

        Returns:
            ``Agreement(flag, ranks)``, alike on every rank that took part:
            the bitwise AND of their flags and their ranks, in order.

        Raises:
            ExcludedError: the others took this rank for failed.
            CommTimeout: a rank neither took part nor failed within ``timeout``
                (default: the communicator's): a rank still in a call on this
                communicator never gets here, so call :meth:`abort` on errors.
            RendezvousError: the store is gone (it died with rank 0 where
                rank 0 served it).
            UnsupportedError: no store (made from a transport, a split's
                group, or PLAIT_RECOVERY=0).
        """
        from plait._recovery import agree

        return agree(self, flag, timeout)

    def shrink(self, *, timeout: float | None = None) -> Communicator:
        """A new communicator of the surviving ranks, renumbered in order; this one is closed.

        Every surviving rank must call it. It aborts this communicator (so
        that no rank stays inside a call on it), agrees on the survivors as
        :meth:`agree` does, and connects them afresh through a new namespace
        of the store: no connection or shared memory of this communicator is
        reused. Raises as :meth:`agree` does, and RendezvousError if the
        survivors cannot connect (one failed meanwhile: shrink again); then
        it raises on every survivor, so they retry together. A group from
        :meth:`split` cannot shrink (UnsupportedError): shrink the
        communicator it was split from and split the new one.
        """
        from plait._shrink import shrink

        return shrink(self, timeout)

    # -- diagnostics -----------------------------------------------------------------------
    def stragglers(
        self, window: int | None = None, *, timeout: float | None = None
    ) -> list[Lateness]:
        """How late each rank arrived at this communicator's last calls, in rank order.

        A rank's lateness at a call is how long after the first rank it began
        it; a rank whose median stands out makes every other rank wait. This
        is itself a collective (every rank must call it, and every rank gets
        the same list): an allreduce of 16 bytes agrees on the calls to
        measure, the last ``window`` calls every rank has completed, and an
        allgather of 24 bytes per call (its number, start and wait) brings
        every rank the others' times (Note [live stragglers] in
        :mod:`plait.diagnostics.stragglers`). The calls it makes, now or in
        an earlier ``stragglers``, are not among those it measures, nor are
        calls that failed. Ranks on one host are compared by their start
        times; across hosts, whose clocks may disagree, through how long each
        rank waited in the synchronizing collectives. ``plait analyze`` gives
        the same numbers from dumps.

        Args:
            window: how many calls to measure, at most; default (and at most)
                the calls the flight recorder keeps (PLAIT_RECORDER_SIZE). The
                smallest value any rank passes is used. Fewer are measured
                where the ring holds fewer of the calls every rank completed:
                each earlier ``stragglers`` call still in it takes two of its
                places, and each failed call one.
            timeout: seconds for each of the two calls it makes.

        Returns:
            One :class:`plait.diagnostics.Lateness` per rank, in seconds, with
            how many calls it measured in ``calls``; 0 for every rank before
            any call completed.

        Raises:
            UnsupportedError: the flight recorder is off (PLAIT_RECORDER_SIZE=0).
            ValueError: ``window`` is not a positive int.
        """
        r = self._rank
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int | np.integer) or window < 1
        ):
            raise ValueError(f"rank {r}: stragglers: window must be an int >= 1; got {window!r}")
        rec = self._runner.recorder
        if rec is None:
            raise UnsupportedError(
                f"rank {r}: stragglers needs the flight recorder, which PLAIT_RECORDER_SIZE=0 "
                "turned off"
            )
        from plait.diagnostics.stragglers import local_calls

        calls = local_calls(rec)  # before its own calls take places in the ring
        wanted = rec.capacity if window is None else min(int(window), rec.capacity)
        mine = np.array([newest_done(calls), wanted], np.int64)
        agreed = self._within(_ALLREDUCE, mine, OWN_CALLS, timeout, MIN)
        hi, n = int(agreed[0]), min(int(agreed[1]), int(agreed[0]) + 1)
        if n <= 0:  # no call completed on every rank yet (alike on every rank)
            return [Lateness(q, 0, 0.0, 0.0, 0.0, None) for q in range(self._size)]
        table = self._within(_ALLGATHER, local_row(calls, hi, n), OWN_CALLS, timeout)
        return from_table(table, local_collectives(calls), same_clock=self.cross_size == 1)

    # -- what the collectives use ------------------------------------------------------------
    def _choose(self, c: str, algorithm: Any, nbytes: int, op: Op | None) -> Choice:
        """The algorithm and segment size of a call: auto's (cached per shape) or the caller's."""
        commutative = op.commutative if op is not None else True
        if not isinstance(algorithm, str):
            raise TypeError(f"rank {self._rank}: {c}: algorithm must be a str; got {algorithm!r}")
        if algorithm == "auto":
            # Not one-sided inside a compressed async allreduce (CallRunner.start refuses it),
            # nor where the window is too small for full pieces and the call does not fit in
            # it (PLAIT_SHM_WINDOW set low): there messages are faster (docs/performance.md).
            # Nor where it cannot hold one piece of every one-sided algorithm (_SMALLEST_WINDOW).
            shared = (
                self._window >= _SMALLEST_WINDOW * self._size
                and not self._runner.reserved()
                and (nbytes <= self._window or self._window >= FULL_WINDOW_BYTES)
            )
            # Across hosts, each host's window (not in a compressed async allreduce either).
            host_windows = self._host_windows > 0 and not self._runner.reserved()
            key = (c, nbytes, commutative, shared, host_windows)
            choice = self._auto.get(key)
            if choice is None:
                uneven = _UNEVEN_AUTO.get(c)
                if uneven is not None:
                    choice = Choice(get(c, uneven(nbytes, commutative)), SEGMENT_BYTES)
                else:
                    choice = choose(
                        c,
                        self._size,
                        nbytes,
                        commutative=commutative,
                        hosts=self._layout,
                        config=self._settings,
                        shared=shared,
                        host_windows=host_windows,
                    )
                if self._log_choices:
                    _log.info(
                        "rank %d: %s of %d bytes on %d ranks: auto chose %s, segment %s (%s)",
                        self._rank,
                        c,
                        nbytes,
                        self._size,
                        choice.name,
                        format_bytes(choice.segment_bytes),
                        choice.source,
                    )
                if len(self._auto) >= CACHE_LIMIT:
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
        if spec.host_windows and not (self._window or self._host_windows) and self._crowded_host():
            raise UnsupportedError(
                f"rank {self._rank}: {c}: algorithm {algorithm!r} needs a shared-memory window "
                "on each host of several ranks, and this communicator has none (a split's "
                "group across hosts, TCP only, or PLAIT_SHM_WINDOW=0); use algorithm='auto' or "
                "'hierarchical'"
            )
        if spec.host_windows and self._window and self._layout is not None:
            raise UnsupportedError(
                f"rank {self._rank}: {c}: algorithm {algorithm!r} needs a window per host, and "
                "this communicator's ranks share one window across its hosts (hosts emulated "
                "over one machine's window); use algorithm='auto' or 'hierarchical'"
            )
        if spec.needs_window and not spec.host_windows and not self._window and self._size > 1:
            # (A lone rank's one-sided call copies its input, and needs no window.)
            raise UnsupportedError(
                f"rank {self._rank}: {c}: algorithm {algorithm!r} is one-sided: it runs only "
                "where all ranks share memory on one host (the shared-memory transport's "
                "window; PLAIT_SHM_WINDOW > 0; a group split from a communicator without one, "
                "such as a world across hosts, has none either); use algorithm='auto' or a "
                "message-passing one"
            )
        return Choice(spec, SEGMENT_BYTES, "caller")

    def _crowded_host(self) -> bool:
        """Whether some host has several of this communicator's ranks."""
        layout = self._layout
        if layout is None:
            return self._size > 1
        return any(len(layout.members(h)) > 1 for h in range(layout.n_hosts))

    def _allreduce_compressed(
        self,
        x: Any,
        op: Op,
        out: Any,
        algorithm: Any,
        timeout: float | None,
        async_op: bool,
        compression: Compression,
    ) -> Any:
        """``allreduce(compression=...)``: see :func:`plait._compressed.allreduce_compressed`."""
        return allreduce_compressed(
            self, self._runner, x, op, out, algorithm, timeout, async_op, compression
        )


_log = logging.getLogger("plait")


def _enable_debug_log() -> None:
    """Show plait's debug log on stderr unless the application configured logging."""
    if not _log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("plait %(levelname)s %(message)s"))
        _log.addHandler(handler)
    _log.setLevel(logging.DEBUG)
