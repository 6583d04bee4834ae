"""Recovery from a lost rank: ``abort``, ``agree`` and ``shrink`` (docs/fault-tolerance.md).

A :class:`~plait.errors.CommError` leaves a communicator broken on the rank
that saw it, and only there: a rank that waits on a healthy peer may wait
until its timeout. ULFM's revoke / agree / shrink is the model of what this
module adds, over the store the ranks met through:

- :func:`abort` makes every call in flight on every rank, and every later
  call, fail with :class:`~plait.errors.AbortedError` (Note [abort]);
- :func:`agree` is a fault-tolerant agreement of the surviving ranks on the
  bitwise AND of their flags and on who they are (Note [agree]);
- :func:`shrink` makes a new communicator of the survivors through a fresh
  namespace of the store and closes the old one (Note [shrink]).

:func:`enable` gives a communicator made by ``plait.init`` (or by
:func:`shrink`) its :class:`Recovery`: the store stays open while it lives, and
a watcher thread waits for aborts and keeps the rank's heartbeat. A
communicator without one (made from a transport, a single rank, or
``PLAIT_RECOVERY=0``) can abort only locally, and agree and shrink refuse.

Note [abort]
    ``abort`` may run on any thread, also in a signal handler, which Python
    runs on the main thread between two bytecodes of whatever it was doing
    (maybe holding the store client's lock, or asleep in the transport's
    poll). So it takes no lock: it marks the call runners aborted (later calls
    raise AbortedError) and starts a thread with
    :func:`_thread.start_new_thread` (unlike :class:`threading.Thread`, it
    takes no Python lock), which (1) sets the key ``abort/<p>`` of every other
    rank ``p`` in the communicator's namespace of the store, (2) waits (at
    most ``_MARK_SECONDS``) for ``marked/<p>`` of every other rank not found
    failed, (3) closes this rank's transport, failing what is in flight here
    with AbortedError (:meth:`Endpoint.abort`), and sets ``closed/<rank>``.
    Each rank's watcher thread blocks in the store on its own ``abort/<rank>``
    (a TCP store parks the request: nothing polls); when it appears, it marks
    the rank's runners, sets ``marked/<rank>``, waits for the other ranks'
    ``marked`` and the aborting rank's ``closed`` (at most ``_MARK_SECONDS``)
    and closes its transport. So no connection closes before every live rank
    has marked its calls: a collective in flight that then sees a peer's
    connections close (or its process exit) fails on a marked runner, which
    reports AbortedError naming the aborting rank and reason
    (:meth:`CallRunner._failed`); so do later calls (a point-to-point one in
    flight may raise PeerLostError).
    ``abort`` returns once (1) and (2) are done, or after ``_TELL_SECONDS``: a
    process that exits right after it (a SIGTERM handler that aborts and
    exits) kills the thread, and peers not yet marked would take the exit for
    a crash. The wait is on a bare lock no other code takes: in a signal
    handler, should the interrupted code hold the store client's lock, it runs
    out and the thread goes on once the handler has returned. It does not wait
    for (3), which a main thread interrupted asleep in the poll lets happen
    only after the handler returns. With the store gone, the abort still
    closes this rank's transport: its peers see it lost.

Note [a store that stalls]
    A store may fail to answer for a while (its host stopped or starved) and answer again.
    The watcher keeps the error in ``store_error`` while the store fails (an abort then
    does not wait on it), tries again a heartbeat later and clears it at the first answer;
    agree and shrink ask once themselves before they refuse, and an abort asks for at most
    ``_PROBE_SECONDS`` before it tells the peers through the store (then waits a heartbeat
    longer for their marks: their watchers look again only then) or, where it does not
    answer, only by closing its transport. The store may also stall unseen, since the
    watcher's last answer: so every store call of the watcher, of an abort and of close
    waits ``_PROBE_SECONDS`` at most beyond what it blocks for (``asking``), and a call
    that gets no answer counts the store as failed. (One stall used to stop the watcher for
    good; an abort on a store that had just stalled told its peers nothing for 10 s.) A
    store that is gone fails each try at once, so agree and shrink still raise at once.

Note [dropped communicators]
    A communicator with recovery that its program drops unclosed is let go of as
    :meth:`Communicator.close` would: a ``weakref.finalize`` on it and on each group split
    from it calls :meth:`Recovery._gone`, and once none of them is left open (the groups
    share its transport) the watcher stops, says the rank closed (``stop/<rank>``), lets go
    of the store and closes the transport, on its own thread. The finalizer may run on any
    thread, the watcher's too, in the middle of a store call: it only sets flags and starts
    a thread that wakes the watcher, whose store calls end before the store is let go of.
    No strong reference leads from the watcher to a communicator; one referenced at the exit
    is left to the exit.

Note [agree]
    Failure assumptions: ranks fail by stopping (a crash, kill -9, or hanging
    so long that they look dead), never by lying; the store is reliable and
    linearizable for the duration (a store that dies makes agree and shrink
    raise RendezvousError at once, not hang). A rank counts as failed when

    - it runs on this machine (same boot id and pid namespace) and its
      process is gone or a zombie (``/proc/<pid>/stat``): known at once; or it
      runs there, not stopped, and closed its communicator (a running process
      of this machine is alive whatever its heartbeat: Note [busy ranks] in
      plait._liveness); or
    - its heartbeat, a counter ``hb/<rank>`` its watcher thread adds to every
      ``HEARTBEAT_SECONDS``, has not moved for ``STALE_SECONDS``; or
    - an earlier agreement of this communicator left it out.

    The transport's lost peers are not used: after an abort every rank closes
    its transport, which on the wire looks the same as dying.

    Agreement number ``k`` of a communicator (every survivor calls agree the
    same number of times) uses the keys ``agree/<k>/...``:

    1. every rank writes its flag to ``flag/<rank>``;
    2. the coordinator is the lowest rank not failed. It waits (in the store,
       a slice at a time) until every rank has either written its flag or
       failed, then claims ``result``: the AND of the flags written and the
       ranks that wrote them (Note [one result] in plait._agreement: exactly
       one rank's claim wins, and only it writes the result);
    3. the others wait for ``result`` a slice at a time, and between slices
       check the ranks below them: when the coordinator fails, the next one
       takes over (its result is computed from the same keys);
    4. everyone returns the result; a rank not in it (it came after the
       coordinator took it for failed) raises ExcludedError.

    A rank that dies after writing its flag is among those that took part:
    the next agree or shrink finds it. A rank that never arrives and is not
    found failed (alive, but still inside a call on the communicator: call
    :func:`abort` when a call fails) makes agree raise CommTimeout at its
    deadline. The coordinator then claims the result *void* (``void <its
    rank> <the ranks missing>``); a rank that times out waiting for the
    result looks ``_LAST_LOOK_SECONDS`` longer, then claims it itself (void
    where a rank is missing: the coordinator, maybe). Every rank that reads
    a void result, a late one when it comes too (the coordinator included),
    raises CommTimeout: no rank ends agreement ``k`` with a result, and every
    rank's next agree is number ``k + 1``. (Were it left undecided, the late
    rank would wait in ``k`` for a rank gone on to ``k + 1``, each for the
    other, until both timed out.) A coordinator taken for failed while alive
    (stopped for more than ``STALE_SECONDS``) claims too, as does the rank
    that took over from it: one claim wins, so one result still.

Note [shrink]
    ``shrink`` agrees (Note [agree]) on the survivors, and aborts the communicator so
    that every rank still in a call on it leaves the call: at once where it failed or was
    aborted on this rank, else only if some rank has neither arrived nor failed
    ``_GRACE_SECONDS`` after this one did. A rank whose calls all succeeded may have peers
    still finishing the last of them (reading this rank's window, or its last message),
    which an abort would fail although the call succeeded here; a rank in shrink is in no
    call, so once every rank has arrived, none needs the abort. Rank ``i`` of the new
    communicator is the ``i``-th survivor in the old order. The survivors connect through
    the store's namespace ``<old>/s<k>`` (``k`` the agreement's number) with the kinds of
    link ``init`` allowed and no job id, so shared-memory segments get fresh names: nothing
    of the old transport is reused; its id is new (:func:`~plait.group.shrunk_comm_id`),
    so its flight recorder dumps, and its splits' ids, are its own. The old communicator
    is then closed. A survivor that dies while the others connect makes shrink fail within
    about a second, naming it (Note [survivors that die] in plait._liveness), on every
    survivor: none returns before all have connected (Note [survivors connect, then agree]
    in plait._shrink); agree and shrink again.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

from plait._abort import (
    abort_alone,
    abort_transport,
    aborted_by,
    as_split,
    asking,
    mark,
    read_abort,
)
from plait._abort import within as _within
from plait._agreement import SETTLE_SECONDS, SLICE, VOID, Ballot
from plait._checks import check_timeout
from plait._fork import not_forked
from plait._liveness import STALE_SECONDS, Liveness
from plait.communicator import Communicator
from plait.errors import (
    ClosedError,
    CommError,
    CommTimeout,
    ExcludedError,
    RendezvousError,
    UnsupportedError,
)
from plait.rendezvous.store import PrefixStore, Store, StoreOwner, StoreTimeout, answers_by

__all__ = [
    "HEARTBEAT_SECONDS",
    "STALE_SECONDS",
    "Agreement",
    "Recovery",
    "abort",
    "agree",
    "closed_error",
    "enable",
    "owned",
]

#: Seconds between two heartbeats of a rank's watcher thread (Note [agree]).
HEARTBEAT_SECONDS = 1.0
#: Seconds a rank whose agreement ran out of time still waits for the coordinator's result,
#: which it decides at the same deadline, before it claims the result itself (Note [agree]).
_LAST_LOOK_SECONDS = 1.0
#: Seconds shrink waits on a healthy communicator for every rank to arrive before it aborts
#: it (Note [shrink]).
_GRACE_SECONDS = 1.0
#: Seconds an abort waits for the other ranks' marks before it closes (Note [abort]).
_MARK_SECONDS = 0.5
#: Seconds ``abort`` waits, at most, until every peer has been told and marked (Note [abort]).
_TELL_SECONDS = 1.0
#: How long an abort asks a store that failed the watcher's last look whether it is back
#: (Note [a store that stalls]); short, as the abort's peers wait for it.
_PROBE_SECONDS = 0.5
#: Seconds beyond its deadline (and last look) an agreement's store calls may wait for
#: their answers, on a store that stopped answering (answers_by).
_ANSWER_SLACK = 1.0
#: Seconds close waits for the watcher thread and for an abort in progress.
_JOIN_SECONDS = 5.0


class Agreement(NamedTuple):
    """What :meth:`Communicator.agree` returns, alike on every rank that took part.

    Attributes:
        flag: the bitwise AND of the flags of the ranks that took part.
        ranks: the ranks that took part, in increasing order (this communicator's
            numbering); the others failed.
    """

    flag: int
    ranks: tuple[int, ...]


class Recovery:
    """A communicator's side of abort, agree and shrink: its namespace, its watcher thread.

    Made by :func:`enable`. It publishes where this rank's process runs, starts the watcher
    thread (Note [abort]; it also keeps the heartbeat of Note [agree]) and closes with the
    communicator.
    """

    def __init__(
        self,
        comm: Communicator,
        owner: StoreOwner,
        namespace: str,
        links: Sequence[str],
    ) -> None:
        self.rank = comm.rank
        self.size = comm.size
        self.namespace = namespace
        self.links = tuple(links)
        self.owner = owner
        self.store: Store = PrefixStore(namespace, owner.store)
        #: Why the watcher stopped early: the store failed (agree and shrink then refuse).
        self.store_error: BaseException | None = None
        self._comm = weakref.ref(comm)
        # The communicators sharing the transport: this one and its split groups.
        self._members: weakref.WeakSet[Communicator] = weakref.WeakSet([comm])
        self._transport = comm._transport
        self._aborted: str | None = None
        self._abort_done = threading.Event()  # set: no abort in progress
        self._abort_done.set()
        self._told = _thread.allocate_lock()  # held until an abort has told the peers
        self._told.acquire()
        self._once = _thread.allocate_lock()  # taken by the one abort, without blocking
        self._agrees = 0
        self.live = Liveness(self.store)  # who counts as failed (Note [busy ranks])
        self._stopping = False
        self._wake = threading.Event()  # close, _check_store: stop, or try the store, now
        self._closed = False
        self._dropped = False  # every member was collected unclosed (Note [dropped ...])
        self._let_go_once = _thread.allocate_lock()  # taken by the one _let_go
        self._nudging = _thread.allocate_lock()  # held by _nudge's store calls
        self._ended = threading.Event()  # set: the watcher is done (and let go, if dropped)
        self.live.publish(self.rank)
        owner.acquire()
        self._thread = threading.Thread(
            target=self._watch, name=f"plait-watch-rank{self.rank}", daemon=True
        )
        self._thread.start()
        # Let go once collected, not at the exit (Note [dropped communicators]).
        weakref.finalize(comm, self._gone).atexit = False

    def adopt(self, comm: Communicator) -> None:
        """``comm`` (a split's group) shares the transport: an abort marks it too."""
        self._members.add(comm)
        comm._recovery = self
        comm._runner.hear = self.hear
        if self._aborted is not None:
            mark(comm, as_split(self._aborted))
        weakref.finalize(comm, self._gone).atexit = False  # Note [dropped communicators]

    def owns(self, comm: Communicator) -> bool:
        """Whether ``comm`` is the communicator this recovery was made for (not a group)."""
        return self._comm() is comm

    # -- abort (Note [abort]) ----------------------------------------------------------------
    def abort(self, reason: str, *, here: bool = False) -> None:
        """Abort here and on every peer; return once they know, at most ``_TELL_SECONDS``
        later. Takes no lock: it may run in a signal handler (Note [abort]). ``here`` (not in
        a signal handler): do it all on this thread, or wait for the abort under way."""
        text = aborted_by(self.rank, reason)
        done = self._mark(text)
        if done is not None and here:
            self._finish_abort(text, reason, done, self.rank)
        elif done is not None:
            _thread.start_new_thread(self._finish_abort, (text, reason, done, self.rank))
        if here:
            self._abort_done.wait(_JOIN_SECONDS)
        elif self._aborted is not None and (told := self._told).acquire(timeout=_TELL_SECONDS):
            told.release()  # a bare lock no other code takes: unlike threading.Event, safe here

    def _mark(self, text: str) -> threading.Event | None:
        """Mark every member's runner aborted; the event to set once the abort is done, or
        None if aborted (or closed) already: once, though a caller and the watcher race."""
        if self._closed or not self._once.acquire(blocking=False):
            return None
        self._aborted = text
        for comm in list(self._members):
            mark(comm, text if self.owns(comm) else as_split(text))
        done = self._abort_done = threading.Event()
        return done

    def _told_nobody(self, done: threading.Event) -> None:
        """End an abort :meth:`_mark` began that tells no peer (every rank replaced the
        communicator with shrink): a later :meth:`abort` returns at once."""
        self._told.release()
        done.set()

    def _finish_abort(self, text: str, reason: str, done: threading.Event, source: int) -> None:
        """Tell every peer through the store (if the abort began here, at ``source``), wait
        until the others marked their calls, close the transport; set ``done``."""
        try:
            marks = _MARK_SECONDS
            if self.store_error is not None and self._store_back(_PROBE_SECONDS):
                self.store_error = None  # back before the watcher's next look: tell through it
                self._wake.set()
                # The peers' watchers saw it fail too, and look again a heartbeat later.
                marks += HEARTBEAT_SECONDS
            if self.store_error is None:
                # The store may have stalled since the watcher last heard it: each ask is
                # answered within _PROBE_SECONDS or the store counts as gone, and the peers
                # learn of the abort from the transport (Note [a store that stalls]).
                store, me = self.store, self.rank
                if source == me:
                    # A reason may hold lone surrogates (str() of an OSError on a
                    # non-UTF-8 file name): escaped, not an error on the abort's thread.
                    payload = f"{me}\n{reason}".encode(errors="backslashreplace")
                    for p in range(self.size):
                        if p != me:
                            with asking(_PROBE_SECONDS):
                                store.set(f"abort/{p}", payload)
                # Its calls are marked: so says every rank, an aborting one too (ranks that
                # all aborted at once each waited out _MARK_SECONDS for the others' marks).
                with asking(_PROBE_SECONDS):
                    store.set(f"marked/{me}", b"1")
                # Close only once the others have marked their calls aborted too (or cannot):
                # none of them then sees this rank's connections close before it knows why.
                seen: dict[int, tuple[int, float]] = {}
                others = []
                for p in range(self.size):
                    if p not in (me, source):
                        with asking(_PROBE_SECONDS):
                            if not self.live.has_failed(p, seen):
                                others.append(f"marked/{p}")
                if source not in (me, -1):  # the aborting rank closes first: its calls fail
                    others.append(f"closed/{source}")  # as aborted (-1: no rank, read_abort)
                with contextlib.suppress(StoreTimeout), asking(marks + _PROBE_SECONDS):
                    store.wait(others, marks)
        except (CommError, OSError) as exc:  # the store is gone: the transport tells them
            self.store_error = exc
        finally:
            self._told.release()  # abort() returns: the peers know, or cannot be told
            try:
                abort_transport(self._transport, self.rank, text)
                if source == self.rank and self.store_error is None:
                    with contextlib.suppress(CommError, OSError), asking(_PROBE_SECONDS):
                        self.store.set(f"closed/{source}", b"1")
            finally:
                done.set()

    def _watch(self) -> None:
        """The watcher thread: :meth:`_listen`, then let go of the transport and the store if
        the communicator was dropped (Note [dropped communicators])."""
        try:
            self._listen()
        finally:
            try:
                if self._dropped:
                    self._let_go()
            finally:
                self._ended.set()

    def _listen(self) -> None:
        """Wait for ``abort/<rank>``, and beat the heartbeat meanwhile; outlive a store that
        fails (Note [a store that stalls])."""
        me = self.rank
        waiting = f"abort/{me}"
        store = self.store
        while not self._stopping:
            try:
                try:
                    with asking(HEARTBEAT_SECONDS + _PROBE_SECONDS):  # a stall: seen soon
                        store.wait([waiting], HEARTBEAT_SECONDS)
                except StoreTimeout:
                    with asking(_PROBE_SECONDS):
                        store.add(f"hb/{me}", 1)
                    self.store_error = None
                    continue
                self.store_error = None
                with asking(_PROBE_SECONDS):
                    if self._stopping or store.check([f"stop/{me}"]) or waiting != f"abort/{me}":
                        return
                    text, reason, source = read_abort(store.get(waiting), self.size)
                done = self._mark(text)
                if done is not None:
                    self._finish_abort(text, reason, done, source)
                waiting = f"stop/{me}"  # keep beating: agree needs it after an abort
            except ClosedError:  # the store was closed here: this rank is done with it
                return
            except (CommError, OSError) as exc:
                if self._stopping:
                    return
                self.store_error = exc
                self._wake.wait(HEARTBEAT_SECONDS)  # close or _check_store sets it; else
                self._wake.clear()  # try again a heartbeat later

    # -- agree (Note [agree]) ----------------------------------------------------------------
    def agree(
        self,
        flag: int,
        seconds: float,
        what: str = "agree",
        late: Callable[[], None] | None = None,
    ) -> tuple[Agreement, int]:
        """The agreement of the surviving ranks and its number (see :func:`agree`).

        ``what`` names the call in errors. ``late`` (shrink's): run once if some rank
        has neither arrived nor failed ``_GRACE`` seconds after this one arrived.
        """
        me = self.rank
        k = self._agrees
        self._agrees += 1
        ballot = Ballot(self.store, self.live, me, self.size, k, what)
        deadline = time.monotonic() + seconds
        # No store call outlasts the agreement's own deadline (Note [a store that stalls]).
        bound = deadline + _LAST_LOOK_SECONDS + _ANSWER_SLACK
        with answers_by(bound):
            self._check_store(what)
        try:
            with answers_by(bound):
                ballot.take_part(flag)
                grace = min(deadline, time.monotonic() + _GRACE_SECONDS)
                if late is not None and ballot.missing(grace):
                    late()
                text = self._outcome(ballot, deadline)
            if text is None:  # another rank's claim won (Note [one result] in plait._agreement)
                with answers_by(time.monotonic() + SETTLE_SECONDS + _ANSWER_SLACK):
                    text = ballot.settle(SETTLE_SECONDS)
        except CommTimeout:  # a StoreTimeout too: the store answered
            raise
        except (RendezvousError, ClosedError, OSError) as exc:
            raise self._store_gone(what, exc) from exc
        value, _, listed = text.partition(" ")
        if value == VOID:
            by, _, missing = listed.partition(" ")
            if by == str(me):
                raise CommTimeout(
                    f"rank {me}: {what}: agree #{k}: rank(s) [{missing}] neither took part "
                    f"nor failed within {seconds:g} s; a rank still inside a call on this "
                    "communicator never gets to agree (call abort() when a call fails)"
                )
            raise CommTimeout(
                f"rank {me}: {what}: agree #{k} was given up by rank {by} at its timeout, "
                f"before rank(s) [{missing}] took part or failed; the next agree of every "
                "rank is the next agreement"
            )
        ranks = tuple(int(r) for r in listed.split(",") if r)
        self.live.failed.update(set(range(self.size)) - set(ranks))
        if me not in ranks:
            raise ExcludedError(
                f"rank {me}: {what}: agree #{k}: the other ranks agreed without this rank (they "
                f"took it for failed; the survivors are ranks {list(ranks)}); close this "
                "communicator"
            )
        return Agreement(int(value), ranks), k

    @staticmethod
    def _outcome(ballot: Ballot, deadline: float) -> str | None:
        """Wait for the result; decide it as coordinator, or, at the deadline and a last
        look, whoever this rank is. None: another rank's claim won (Ballot.settle)."""
        while True:
            if ballot.coordinator() == ballot.rank:
                return ballot.decide(deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                # The coordinator decides at the same deadline: its word, if it comes; else
                # this rank claims the result (void where some rank never came).
                text = ballot.wait(_LAST_LOOK_SECONDS)
                return text if text is not None else ballot.decide(time.monotonic())
            text = ballot.wait(min(SLICE, left))
            if text is not None:
                return text

    def _store_back(self, seconds: float) -> bool:
        """Whether the store answers within ``seconds`` (Note [a store that stalls])."""
        return _within(seconds, lambda: self.store.check([f"stop/{self.rank}"]))

    def hear(self) -> None:
        """A call failed: mark the abort that waits in the store for this rank, if the
        watcher has yet to read it (Note [an abort heard late])."""
        if self._aborted is not None or self._closed or self.store_error is not None:
            return
        key, found = f"abort/{self.rank}", []

        def look() -> None:
            if self.store.check([key]):
                found.append(self.store.get(key))

        if not _within(_PROBE_SECONDS, look):
            return
        if found and found[0]:  # (close writes an empty one, to wake the watcher)
            text, reason, source = read_abort(found[0], self.size)
            done = self._mark(text)
            if done is not None:
                _thread.start_new_thread(self._finish_abort, (text, reason, done, source))

    def _check_store(self, what: str) -> None:
        """Raise if the store fails; where the watcher last saw it fail, ask it once more
        (it may be back before the watcher's next try: Note [a store that stalls])."""
        if self.store_error is not None:
            try:
                self.store.check([f"stop/{self.rank}"])
            except (CommError, OSError) as exc:
                raise self._store_gone(what, exc) from exc
            self.store_error = None
            self._wake.set()  # the watcher listens for aborts again now, not a heartbeat on

    def _store_gone(self, what: str, exc: BaseException) -> CommError:
        if self._closed:  # not the store: close() from another thread cut its wait short
            return ClosedError(f"rank {self.rank}: {what} cut short: the communicator was closed")
        return RendezvousError(
            f"rank {self.rank}: {what}: the store the ranks met through is unreachable ({exc}); "
            f"{what} needs it. Where rank 0 served it (MASTER_ADDR, torchrun-style launches) it "
            "died with rank 0: restart the job (plait run --max-restarts), or serve the store "
            "apart from the ranks (plait run, PLAIT_STORE)"
        )

    # -- lifetime ----------------------------------------------------------------------------
    def closing(self, comm: Communicator) -> None:
        """``comm`` (or a group of it) closes its transport: an abort tells the peers first."""
        self._abort_done.wait(_JOIN_SECONDS)
        if self.owns(comm):
            self.close()

    def close(self) -> None:
        """Stop the watcher, wait for an abort in progress, let go of the store. Idempotent."""
        if self._closed:
            return
        self._abort_done.wait(_JOIN_SECONDS)
        self._closed = True
        self._stopping = True
        self._wake.set()
        me = self.rank
        if self._thread.is_alive():
            if self.store_error is None:  # else the watcher is between tries: _wake stops it
                # (a store that stalled since the watcher's last look: not waited on)
                with contextlib.suppress(CommError, OSError), asking(_PROBE_SECONDS):
                    self.store.set(f"stop/{me}", b"1")
                    self.store.set(f"abort/{me}", b"")  # wakes a watcher waiting for an abort
            self._thread.join(_JOIN_SECONDS)
        self.owner.release()

    def _gone(self) -> None:
        """A member was collected: if no member is left open, stop the watcher, which then
        lets go. Runs on whatever thread freed the member, the watcher's too, maybe inside a
        store call or a lock: it takes no lock, waits for nothing and raises nothing."""
        if self._closed or self._dropped or any(not m.closed for m in list(self._members)):
            return
        self._dropped = True
        self._stopping = True  # (without the nudge, the watcher sees it a heartbeat later)
        with contextlib.suppress(RuntimeError):  # no new thread at the interpreter's exit
            _thread.start_new_thread(self._nudge, ())

    def _nudge(self) -> None:
        """Wake the watcher of a dropped communicator (as :meth:`close` does), which lets go
        on its way out; let go here where it ended before, or does not end in time."""
        self._wake.set()
        with self._nudging:  # not once the store is let go of: its client would connect again
            if not self._closed:
                self._say_stopped(f"abort/{self.rank}")  # wakes a wait for an abort, or stop
        self._ended.wait(_JOIN_SECONDS)  # (not join(): this thread is not threading's)
        self._let_go()

    def _let_go(self) -> None:
        """What :meth:`Communicator.close` does, for a dropped one: wait for an abort in
        progress, say this rank closed (``stop/<rank>``: Note [busy ranks] in
        plait._liveness), let go of the store, close the transport. Once, on a thread of its
        own (the watcher's, or :meth:`_nudge`'s); errors pass, nobody is left to hear them."""
        if not self._let_go_once.acquire(blocking=False):
            return
        self._abort_done.wait(_JOIN_SECONDS)
        with self._nudging:
            self._closed = True
        try:
            self._say_stopped()
            self.owner.release()
        finally:
            with contextlib.suppress(CommError, OSError):
                self._transport.close()

    def _say_stopped(self, *wake: str) -> None:
        """Set ``stop/<rank>`` (and the keys ``wake``, empty) where the store answers soon."""
        if self.store_error is not None:  # the watcher is between tries: _wake stops it
            return
        with contextlib.suppress(CommError, OSError), answers_by(time.monotonic() + _JOIN_SECONDS):
            self.store.set(f"stop/{self.rank}", b"1")
            for key in wake:
                self.store.set(key, b"")


# -- what the communicator's methods call ----------------------------------------------------------
# Note [an abort heard late]
#     A rank stopped (SIGSTOP, a debugger) while the others timed out, aborted and shrank
#     finds, once it runs again, its call failed by what the others left: a connection
#     closed, a peer that gave up. Its watcher
#     reads the abort waiting for it in the store a moment later, too late for that call,
#     which raised MismatchError or PeerLostError where every call cut short by an abort
#     raises AbortedError. So a call that fails on a communicator with recovery first asks
#     the store, for at most _PROBE_SECONDS, whether an abort waits for this rank, and
#     marks it as the watcher would (CallRunner._failed calls ``hear``).


def enable(
    comm: Communicator,
    store: Store | StoreOwner,
    namespace: str,
    links: Sequence[str],
) -> Recovery:
    """Give ``comm`` its :class:`Recovery` in ``namespace`` of ``store`` (kept open meanwhile)."""
    owner = store if isinstance(store, StoreOwner) else StoreOwner(store)
    rec = Recovery(comm, owner, namespace, links)
    comm._recovery = rec
    comm._runner.hear = rec.hear
    return rec


def abort(comm: Communicator, reason: str = "") -> None:
    """See :meth:`Communicator.abort` and Note [abort]."""
    if not isinstance(reason, str):
        raise TypeError(f"rank {comm.rank}: abort: reason must be a str; got {reason!r}")
    not_forked(comm._runner, "abort")  # the store and transport are the parent's
    rec = comm._recovery
    if rec is not None:
        rec.abort(reason)
    else:
        abort_alone(comm, reason)


def owned(comm: Communicator, what: str) -> Recovery | None:
    """``comm``'s recovery for agree and shrink; None for a lone rank without one."""
    not_forked(comm._runner, what)
    rec = comm._recovery
    if rec is not None and rec.owns(comm):
        return rec
    if comm.closed:  # a lone rank's too: replaced by shrink, or closed
        raise closed_error(comm, what)
    if rec is None and comm.size == 1:
        return None
    why = (
        "a split's group: call it on the communicator it was split from"
        if rec is not None
        else comm._no_recovery
    )
    raise UnsupportedError(
        f"rank {comm.rank}: {what} needs the store the ranks met through, and this "
        f"communicator has none of its own: it was {why}"
    )


def closed_error(comm: Communicator, what: str) -> ClosedError:
    """``what`` on a closed communicator; one that shrink replaced says so."""
    why = comm._runner.aborted
    return ClosedError(
        f"rank {comm.rank}: {what} on a closed communicator" + (f" ({why})" if why else "")
    )


def agree(comm: Communicator, flag: int, timeout: float | None) -> Agreement:
    """See :meth:`Communicator.agree` and Note [agree]."""
    if isinstance(flag, bool) or not isinstance(flag, int):
        try:
            flag = int(flag.__index__())  # numpy integers
        except AttributeError:
            raise TypeError(f"rank {comm.rank}: agree: flag must be an int; got {flag!r}") from None
    seconds = (
        comm.timeout if timeout is None else check_timeout(timeout, f"rank {comm.rank}: agree")
    )
    rec = owned(comm, "agree")
    if rec is None:
        return Agreement(int(flag), (0,))
    if rec._closed:
        raise closed_error(comm, "agree")
    return rec.agree(int(flag), seconds)[0]
