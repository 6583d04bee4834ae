"""A failure on another host of the job, seen in its store by this host's launcher.

Note [a failure on another host]
    Each host's ``plait run`` watches its own ranks; after the launchers meet, nothing
    told one of a failure on another. A rank that failed on host 0 stopped host 0's
    ranks, and host 1's ranks went on until they next needed a rank of host 0 (a rank
    that computed alone for a while ran to its end), after which host 1's launcher could
    even exit 0: a job that failed, reported as done on one host. So without
    ``--enable-recovery`` the launchers settle in the job's store which rank started the
    failure (Note [which host started a failure]), and each launcher looks there, once
    every :data:`LOOK_SECONDS` (one round trip), for that verdict; one that names a rank of
    another host stops its own ranks and exits with that rank's code, as ``mpirun`` ends a
    whole job. With ``--enable-recovery`` a lost rank is the survivors' to handle, and
    nobody looks. A store that is gone says nothing: host 0's launcher serves it, and it
    ends when host 0's part of the job does, failed (settled first) or done.

Note [which host started a failure]
    A rank that dies makes its peers on every host fail too (PeerLostError), and each host's
    launcher names the rank of its own that started its failure (Note [which rank started a
    failure] in plait.launch.watch): on the hosts without the cause, a bystander. Naming
    the lowest rank any launcher filed lost blamed one (host 1's rank 2, which raised
    PeerLostError after its rank 3 died); and a launcher that took the first filing of
    another host it saw, while it still waited for a cause of its own, blamed another
    (host 0's rank 0, whose failure followed from host 1's rank 3). So the launchers order
    their failures in the store, where every host sees the same order:

    1. at its first failed rank a launcher draws a ticket, ``plait/failing`` counted up by
       one (:meth:`Elsewhere.ticket`): the host that saw a failure first holds ticket 1;
    2. once it has named its own first failure, it files it, ``plait/first/<ticket>``: how
       likely a cause it is (the kind of plait.launch.watch, 0 the likeliest), the rank and
       how it ended (:meth:`Elsewhere.file`), before the ranks it files lost;
    3. it then waits (:meth:`Elsewhere.verdict`, at most :data:`GATHER_SECONDS`) for the
       filings of every smaller ticket, and where its own is not the likeliest kind, for
       those of every ticket drawn (a host that drew a later one may hold a likelier cause
       that took longer to name: one that hangs on its way out, found only once its
       bystanders have ended) and, for a symptom (a PeerLostError), until
       :data:`plait.launch.watch.LINGER_SECONDS` after its first failure; the failure
       that started the job's is the likeliest kind filed, the one of the smallest ticket
       among those;
    4. the first launcher to claim it (``plait/verdict-claim`` counted up to 1) writes it
       as ``plait/verdict``; the others read that one, whatever they chose themselves, so
       that every host names one rank and exits with one code.

    A launcher whose ranks did not fail waits for the verdict alone. A verdict that comes
    while a launcher still waits for a cause of its own ends that wait, and it names that
    rank of another host: the launcher that claimed it drew the smaller ticket, or waited
    for this one's filing. Where the store does not answer, a launcher names its own first
    failure, as with one host.
"""

from __future__ import annotations

import queue
import re
import signal
import threading
import time
from contextlib import suppress

from plait.errors import CommError
from plait.rendezvous.store import StoreTimeout
from plait.rendezvous.tcp_store import TCPStore

__all__ = [
    "ELSEWHERE",
    "GATHER_SECONDS",
    "LOOK_SECONDS",
    "STOPPED",
    "Elsewhere",
    "exit_code",
    "linger",
]

#: Seconds between two looks at the store.
LOOK_SECONDS = 1.0
#: Most seconds host 0's launcher keeps serving the store for the others to see a failure.
LINGER_SECONDS = 3.0
#: Most seconds a launcher waits for the filings of the hosts that failed before it. It
#: waits this long only where a filing never comes (its launcher died); a host that names a
#: likelier cause late (a bystander slow to end, then its linger) files 4-5 s after its
#: ticket on a busy machine, which 6 s left too little room for.
GATHER_SECONDS = 15.0
#: Seconds between two looks for filings while a launcher gathers them.
_SLICE_SECONDS = 0.25
#: Seconds one call to the store may take from the launcher's own thread.
_STORE_SECONDS = 5.0
#: Where each host's launcher says it saw a failure elsewhere.
_SEEN = "plait/lost-seen"
#: Tickets drawn, first filings, the claim and the verdict (Note [which host started...]).
_FAILING = "plait/failing"
_FIRST = "plait/first"
_CLAIM = "plait/verdict-claim"
_VERDICT = "plait/verdict"
#: A launcher whose ranks all ended with 0, one of them before plait.init, says so here.
_ENDED = "plait/ended-early"
#: The rank field of the event a failure elsewhere puts on the launcher's queue.
ELSEWHERE = -2
#: How a launcher files the ranks it stopped after another failed (plait.launch.watch).
STOPPED = "was stopped by its launcher"


class Elsewhere:
    """Settles with the other hosts' launchers which rank started a failure (Note [which
    host started a failure]), and watches the job's store for the verdict: puts
    ``(ELSEWHERE, rank)`` on ``events`` when it names a rank of another host (Note [a
    failure on another host])."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        node: int,
        mine: range,
        size: int,
        events: queue.SimpleQueue[tuple[int, int]],
    ) -> None:
        self._address = (host, port, secret.encode())
        self._node = node
        self._others = [r for r in range(size) if r not in mine]
        self._nodes = size // len(mine) if len(mine) else 1
        self._events = events
        self._stop = threading.Event()
        #: How each rank a verdict named ended.
        self.how: dict[int, str] = {}
        #: Whether this launcher has read (or written) the verdict.
        self.settled = False
        self._store: TCPStore | None = None  # the launcher's own thread's connection
        self._thread = threading.Thread(target=self._look, name="plait-run-elsewhere", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop looking (the thread ends at its next look)."""
        self._stop.set()
        if self._store is not None:
            with suppress(CommError, OSError):
                self._store.close()
            self._store = None

    def _connect(self) -> TCPStore:
        if self._store is None:
            host, port, secret = self._address
            self._store = TCPStore(
                host, port, secret=secret, timeout=_STORE_SECONDS, connect_timeout=_STORE_SECONDS
            )
        return self._store

    def ticket(self) -> int | None:
        """Draw this host's place among the hosts that saw a failure (1: the first); None
        where the store does not answer."""
        try:
            return self._connect().add(_FAILING, 1)
        except (CommError, OSError):
            return None

    def file(self, ticket: int, kind: int, rank: int, how: str) -> bool:
        """File this host's first failure, drawn ``ticket``: rank ``rank`` ended ``how``, a
        failure of ``kind`` (0 the likeliest cause). False where the store does not answer."""
        try:
            self._connect().set(f"{_FIRST}/{ticket}", f"{kind} {rank} {how}".encode())
        except (CommError, OSError):
            return False
        return True

    def verdict(self, ticket: int, kind: int, better_until: float) -> tuple[int, str] | None:
        """The rank that started the job's failure and how it ended, as every launcher names
        it, after this host filed its own (:meth:`file`); ``better_until``: until when
        (``time.monotonic()``) to wait for a failure of a likelier kind than ``kind``
        elsewhere. None where the store does not answer."""
        try:
            store = self._connect()
            chosen = _gather(store, ticket, kind, better_until)
            if chosen is not None and store.add(_CLAIM, 1) == 1:
                store.set(_VERDICT, f"{chosen[0]} {chosen[1]}".encode())
            else:
                chosen = _read(store.get(_VERDICT, _STORE_SECONDS))  # another launcher's claim
        except (CommError, OSError):
            return None
        self.seen()
        return chosen

    def outcome(self, seconds: float) -> tuple[int, str] | None:
        """The verdict, for a launcher whose ranks all ended with 0, one of them before it
        joined ``plait.init``, where ranks of another host may wait there for it: waited for
        up to ``seconds``, or until every other host's launcher said the same of its ranks
        (a command that never calls ``plait.init``). None where none came, or the store is
        gone (host 0's launcher ended)."""
        others = [f"{_ENDED}/{n}" for n in range(self._nodes) if n != self._node]
        deadline = time.monotonic() + seconds
        try:
            store = self._connect()
            store.set(f"{_ENDED}/{self._node}", b"1")
            while not store.check([_VERDICT]):
                left = deadline - time.monotonic()
                if left <= 0 or store.check(others):
                    return None
                with suppress(StoreTimeout):
                    store.wait([_VERDICT], timeout=min(_SLICE_SECONDS, left))
            chosen = _read(store.get(_VERDICT))
        except (CommError, OSError):
            return None
        self.seen()
        return chosen

    def seen(self) -> None:
        """Say that this launcher has read the verdict and needs the store no more: host 0's
        may stop serving it (:func:`linger`)."""
        self.settled = True
        with suppress(CommError, OSError):
            self._connect().set(f"{_SEEN}/{self._node}", b"1")

    def _look(self) -> None:
        host, port, secret = self._address
        try:
            with TCPStore(host, port, secret=secret, timeout=30.0, connect_timeout=10.0) as store:
                while not self._stop.is_set():
                    try:
                        store.wait([_VERDICT], timeout=LOOK_SECONDS)
                    except StoreTimeout:
                        continue
                    rank, how = _read(store.get(_VERDICT))
                    if self._stop.is_set():
                        return
                    if rank in self._others:  # else this launcher is settling it itself
                        self.how[rank] = how
                        self._events.put((ELSEWHERE, rank))  # the launcher says seen()
                    return
        except (CommError, OSError):  # the store is gone: host 0's part of the job ended
            return


def _gather(store: TCPStore, ticket: int, kind: int, better_until: float) -> tuple[int, str] | None:
    """The first failure of the job among the hosts' filings (Note [which host started a
    failure]), once those of the tickets before ``ticket`` are in and, for ``kind`` a
    symptom, a likelier one came or ``better_until`` passed; None where a verdict was
    written meanwhile."""
    deadline = time.monotonic() + GATHER_SECONDS
    got: dict[int, tuple[int, int, str]] = {}
    while not store.check([_VERDICT]):
        taken = store.add(_FAILING, 0)
        for t in range(1, taken + 1):
            if t not in got and store.check([f"{_FIRST}/{t}"]):
                k, rank, how = store.get(f"{_FIRST}/{t}").decode(errors="replace").split(" ", 2)
                got[t] = (int(k), int(rank), how)
        now = time.monotonic()
        # A cause waits for the tickets before its own; a likelier cause may have drawn any
        waiting = [t for t in range(1, ticket if kind == 0 else taken + 1) if t not in got]
        better = any(k < kind for k, _, _ in got.values())
        if got and (now >= deadline or (not waiting and (better or now >= better_until))):
            t = min(got, key=lambda t: (got[t][0], t))
            return got[t][1], got[t][2]
        if now >= deadline:  # not even this host's own filing: the store lost it
            raise StoreTimeout(f"no failure filed in {GATHER_SECONDS} s")
        missing = next(t for t in range(1, taken + 2) if t not in got)
        with suppress(StoreTimeout):
            store.wait([f"{_FIRST}/{missing}"], timeout=min(_SLICE_SECONDS, deadline - now))
    return None


def _read(value: bytes) -> tuple[int, str]:
    """A verdict's rank and how it ended."""
    rank, how = value.decode(errors="replace").split(" ", 1)
    return int(rank), how


def linger(host: str, port: int, secret: str, nnodes: int) -> None:
    """On host 0, whose launcher serves the store, after the job failed: wait (at most
    :data:`LINGER_SECONDS`) until every other host's launcher has read the verdict, so
    that the store does not end before they look (Note [a failure on another host])."""
    keys = [f"{_SEEN}/{n}" for n in range(1, nnodes)]
    try:
        with TCPStore(host, port, secret=secret.encode(), timeout=LINGER_SECONDS) as store:
            store.wait(keys, timeout=LINGER_SECONDS)
    except (CommError, OSError):  # StoreTimeout: a host whose ranks had all ended
        pass


def exit_code(how: str) -> int:
    """The exit code a launcher reports for a rank that ended ``how`` ("exited with code 3",
    "was killed by SIGKILL": 137); 1 where it does not say."""
    if m := re.search(r"exited with code (\d+)", how):
        return int(m.group(1)) or 1
    if m := re.search(r"killed by (SIG[A-Z0-9]+)", how):
        try:
            return 128 + signal.Signals[m.group(1)]
        except KeyError:
            return 1
    return 1
