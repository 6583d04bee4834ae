"""Whether a rank of a communicator with recovery counts as failed (Note [agree] in
:mod:`plait._recovery`), for agree, for an abort's wait on its peers, and for the waits of
a shrunk communicator's set-up (Note [survivors that die])."""

from __future__ import annotations

import time
from collections.abc import Sequence

from plait._processes import Process, alive, stopped, this_process
from plait.rendezvous.lost import Watched
from plait.rendezvous.store import Store

__all__ = ["STALE_SECONDS", "Liveness", "survivors_store"]

#: Seconds without a heartbeat after which a rank counts as failed (Note [agree]).
STALE_SECONDS = 5.0

# Note [busy ranks]
#     A rank's heartbeat is added by its watcher thread, which needs the GIL: a main thread
#     in one long call of C code that holds it (a large pickle or json.dumps, sum(range(n)))
#     starves the heartbeat as a dead rank's would. Where a rank's process is on this
#     machine, its state says more: gone (or a zombie) is failed at once; running is alive,
#     whatever its heartbeat, until it closes its communicator (``stop/<rank>``, which is
#     what a rank that returns from its training loop leaves); stopped (SIGSTOP, a
#     debugger) is judged by its heartbeat, as a process on another machine always is. So
#     a busy rank of this machine is waited for, never voted out (it was, after 5 s of
#     such a call), and a rank on another machine still counts as failed after
#     STALE_SECONDS without a heartbeat.


class Liveness:
    """Which ranks of one recovery namespace count as failed, from the store and /proc."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.failed: set[int] = set()  # ranks an earlier agreement left out
        self._procs: dict[int, Process] = {}

    def publish(self, rank: int) -> None:
        """Say where this process runs, and give it a first heartbeat."""
        me = this_process()
        self.store.set(f"proc/{rank}", f"{me.machine}\n{me.pid}\n{me.start}".encode())
        self.store.add(f"hb/{rank}", 1)

    def has_failed(self, p: int, seen: dict[int, tuple[int, float]]) -> bool:
        """Whether rank ``p`` counts as failed now; ``seen``: its heartbeats as seen so far."""
        return self.how(p, seen) is not None

    def how(self, p: int, seen: dict[int, tuple[int, float]]) -> str | None:
        """How rank ``p`` failed, or None while it counts as alive (Note [busy ranks])."""
        if p in self.failed:
            return "was left out by an earlier agreement"
        proc = self.process(p)
        if proc is not None and proc.machine and proc.machine == this_process().machine:
            if not alive(proc):
                return "exited"
            if not stopped(proc):
                return "closed its communicator" if self.store.check([f"stop/{p}"]) else None
        beat = self.store.add(f"hb/{p}", 0)
        now = time.monotonic()
        last = seen.get(p)
        if last is None or last[0] != beat:
            seen[p] = (beat, now)
            return None
        if now - last[1] < STALE_SECONDS:
            return None
        return f"gave no heartbeat for {STALE_SECONDS:g} s"

    def process(self, p: int) -> Process | None:
        """Where rank ``p`` runs, as it published (None if it never did)."""
        if p in self._procs:
            return self._procs[p]
        key = f"proc/{p}"
        if not self.store.check([key]):
            return None
        machine, pid, start = self.store.get(key).decode().split("\n")
        proc = self._procs[p] = Process(machine, int(pid), start)
        return proc


# Note [survivors that die]
#     shrink's agreement names the survivors; a survivor that dies after it wrote its flag
#     (while it waited for the others) is among them, and the set-up of the new
#     communicator waited for it until its timeout (300 s by default). Its set-up runs in a
#     namespace of the store whose waits ask the old communicator's liveness between two
#     slices (a Watched view: Note [lost ranks] in plait.rendezvous.lost), with each new
#     rank mapped to its old number, so that such a death ends the set-up within about a
#     second, with a PeerLostError naming the rank; every survivor then agrees and shrinks
#     again, as the shrink error says. A survivor that dies once every one has connected is
#     in the new communicator, and its next agree must see it gone: so each survivor says
#     where it runs (``proc/<rank>``) in the new namespace before it says it connected.
#     The new communicator's liveness looked for it there; where it had died before its
#     Recovery published it, the agree found no process and waited out STALE_SECONDS.


def survivors_store(prefix: str, store: Store, live: Liveness, members: Sequence[int]) -> Watched:
    """The namespace ``prefix`` of ``store`` in which the new rank ``r`` is the old rank
    ``members[r]``, whose death ``live`` tells (Note [survivors that die])."""
    seen: dict[int, tuple[int, float]] = {}

    def dead(ranks: Sequence[int]) -> dict[int, str]:
        out = {}
        for r in ranks:
            how = live.how(members[r], seen)
            if how is not None:
                was = f"(rank {members[r]} before the shrink) " if members[r] != r else ""
                out[r] = was + how
        return out

    return Watched(prefix, store, dead, "shrink", members)
