"""A failure on another host of the job, seen in its store by this host's launcher.

Note [a failure on another host]
    Each host's ``plait run`` watches its own ranks; after the launchers meet, nothing
    told one of a failure on another. A rank that failed on host 0 stopped host 0's
    ranks, and host 1's ranks went on until they next needed a rank of host 0 (a rank
    that computed alone for a while ran to its end), after which host 1's launcher could
    even exit 0: a job that failed, reported as done on one host. Every launcher of a job
    on several hosts already files each of its ranks that failed in the job's store
    (:func:`~plait.rendezvous.lost.report_lost`, for the ranks still in ``plait.init``).
    So without ``--enable-recovery`` each launcher also looks there, once every
    :data:`LOOK_SECONDS` (one round trip), for a rank of another host filed lost; on one
    it stops its own ranks and exits with that rank's code, as ``mpirun`` ends a whole
    job. With ``--enable-recovery`` a lost rank is the survivors' to handle, and nobody
    looks. A store that is gone says nothing: host 0's launcher serves it, and it ends
    when host 0's part of the job does, failed (filed first) or done.
"""

from __future__ import annotations

import queue
import re
import signal
import threading

from plait.errors import CommError
from plait.rendezvous.lost import COUNT, lost_count, reports
from plait.rendezvous.store import StoreTimeout
from plait.rendezvous.tcp_store import TCPStore

__all__ = ["ELSEWHERE", "LOOK_SECONDS", "STOPPED", "Elsewhere", "exit_code", "linger"]

#: Seconds between two looks at the store.
LOOK_SECONDS = 1.0
#: Most seconds host 0's launcher keeps serving the store for the others to see a failure.
LINGER_SECONDS = 3.0
#: Where each host's launcher says it saw a failure elsewhere.
_SEEN = "plait/lost-seen"
#: The rank field of the event a failure elsewhere puts on the launcher's queue.
ELSEWHERE = -2
#: How a launcher files the ranks it stopped after another failed (plait.launch.watch).
STOPPED = "was stopped by its launcher"


class Elsewhere:
    """Watches the job's store for ranks of other hosts filed lost (Note [a failure on
    another host]); puts ``(ELSEWHERE, rank)`` on ``events`` for the first one found."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        node: int,
        mine: range,
        size: int,
        events: queue.Queue[tuple[int, int]],
    ) -> None:
        self._address = (host, port, secret.encode())
        self._node = node
        self._others = [r for r in range(size) if r not in mine]
        self._events = events
        self._stop = threading.Event()
        #: How each rank found lost ended, as its launcher filed it.
        self.how: dict[int, str] = {}
        self._thread = threading.Thread(target=self._look, name="plait-run-elsewhere", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop looking (the thread ends at its next look)."""
        self._stop.set()

    def _look(self) -> None:
        host, port, secret = self._address
        try:
            with TCPStore(host, port, secret=secret, timeout=30.0, connect_timeout=10.0) as store:
                seen = 0
                while not self._stop.is_set():
                    if seen == 0:  # the first filing ends the store's wait at once
                        try:
                            store.wait([COUNT], timeout=LOOK_SECONDS)
                        except StoreTimeout:
                            continue
                    elif self._stop.wait(LOOK_SECONDS):
                        return
                    count = lost_count(store)
                    if count == seen:
                        continue
                    seen = count
                    found = reports(store, self._others)
                    if found and not self._stop.is_set():
                        # The rank that failed, not one its launcher stopped after it.
                        failed = [r for r in found if not found[r].startswith(STOPPED)]
                        first = min(failed or found)
                        self.how[first] = found[first]
                        self._events.put((ELSEWHERE, first))
                        store.set(f"{_SEEN}/{self._node}", b"1")  # host 0 may stop serving
                        return
        except (CommError, OSError):  # the store is gone: host 0's part of the job ended
            return


def linger(host: str, port: int, secret: str, nnodes: int) -> None:
    """On host 0, whose launcher serves the store, after it filed a failed rank: wait (at
    most :data:`LINGER_SECONDS`) until every other host's launcher has seen it, so that
    the store does not end before they look (Note [a failure on another host])."""
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
