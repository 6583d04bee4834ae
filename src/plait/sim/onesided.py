"""One-sided steps in the simulation: posts, the steps that wait for them, and what they cost.

Ranks that share an arena (one host) exchange data through their windows
(``SHARED``) instead of messages (the one-sided steps of :mod:`plait.schedule.ir`).
The engine (:mod:`plait.sim.engine`) hands them here and charges:

* ``POST``: nothing on the poster (it writes a counter in shared memory); the
  post becomes visible to a peer ``r`` after the network's wait latency
  (:meth:`Network.set_wait_latency <plait.sim.network.Network.set_wait_latency>`,
  ``plait sim --wait-latency``: one figure for the host's memory), or, where
  that is not set, after the latency a message from the poster to ``r`` would
  have (its route's links plus the network's per-message latency: on
  :func:`plait.sim.hosts`, the intra-host α);
* ``WAIT`` on (``q``, ``k``): finishes once its dependencies are done and
  ``q``'s first post of a phase ``>= k`` is visible to it;
* ``GET`` and ``GET_REDUCE``: start as a ``WAIT`` would finish, then are the
  reader's local work, like a ``COPY`` (δ seconds per byte) or a ``REDUCE``
  (γ) of their bytes, one at a time with its other local work. They read host
  memory, so no link of the network carries them.

A *mixed* program (Note [mixed schedules] in :mod:`plait.schedule.ir`: messages
between hosts, one-sided steps within each) is charged the same way: its messages
are flows on the network as in any program, its one-sided steps as above, each
after the window step before it (the chain) and the messages whose data it
shares; so a piece's messages overlap the window steps of the next. Its
one-sided steps must name a rank of the reader's own host (``Network.hosts``:
a window per host); one that names a rank on another host is refused.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from plait.sim.network import Network
from plait.sim.program import GET, POST, WAIT, Program, describe

__all__ = ["OneSided", "check_hosts"]

#: ``push(when, g)``: schedule an event for step ``g`` at time ``when``.
Push = Callable[[float, int], None]


class OneSided:
    """The posts of a simulation and the steps waiting for them (see the module docstring).

    Args:
        program: the compiled steps.
        network: where they run (its γ and δ per rank, its wait latency).
        latency: ``latency(q, r)``, seconds a message from ``q`` to ``r`` takes to
            arrive: how long a post of ``q`` takes to be visible to ``r`` where the
            network sets no wait latency.
        visible: schedules the event that starts a step whose post became visible.
        local_done: schedules the end of a step's local work.
        busy: per rank, when its local work queue drains (the engine's list, shared).
        start_t: the engine's per-step start times, to fill in; None when not recording.

    Raises:
        ValueError: a mixed program's one-sided step names a rank on another host.
    """

    def __init__(
        self,
        program: Program,
        network: Network,
        latency: Callable[[int, int], float],
        visible: Push,
        local_done: Push,
        busy: list[float],
        start_t: list[float] | None,
    ) -> None:
        if program.mixed and network.hosts is not None:
            check_hosts(program, network.hosts)
        self.prog = program
        fixed = network.wait_latency
        self.route_latency = latency if fixed is None else (lambda q, r: fixed)
        self.latencies: dict[int, float] = {}  # q * p + r -> latency(q, r)
        self.visible = visible
        self.local_done = local_done
        self.busy = busy
        self.gamma = network.gamma
        self.delta = network.delta
        self.start_t = start_t
        p = program.size
        self.phases: list[list[int]] = [[] for _ in range(p)]  # per rank, the phases posted
        self.times: list[list[float]] = [[] for _ in range(p)]  # ... and when
        self.waiting: list[list[int]] = [[] for _ in range(p)]  # per poster, steps waiting
        self.stuck: set[int] = set()  # steps whose post has not happened (yet)

    def latency(self, q: int, r: int) -> float:
        """Seconds until a post of ``q`` is visible to ``r`` (looked up once per pair)."""
        key = q * self.prog.size + r
        lat = self.latencies.get(key)
        if lat is None:
            lat = self.latencies[key] = self.route_latency(q, r)
        return lat

    def post(self, g: int, t: float) -> None:
        """Step ``g``, a ``POST``, runs at ``t``: wake the steps that wait for it."""
        prog = self.prog
        q, phase = prog.owner[g], prog.tag[g]
        self.phases[q].append(phase)
        self.times[q].append(t)
        line = self.waiting[q]
        if not line:
            return
        keep = []
        for w in line:
            if prog.tag[w] <= phase:
                self.stuck.discard(w)
                self.visible(t + self.latency(q, prog.owner[w]), w)
            else:
                keep.append(w)
        self.waiting[q] = keep

    def begin(self, g: int, t: float) -> bool:
        """``g`` (a ``GET``, ``GET_REDUCE`` or ``WAIT``) is ready at ``t``; True if done at once."""
        prog = self.prog
        q, r = prog.peer[g], prog.owner[g]
        i = bisect.bisect_left(self.phases[q], prog.tag[g])
        if i == len(self.phases[q]):  # not posted yet: post() starts it
            self.waiting[q].append(g)
            self.stuck.add(g)
            return False
        when = self.times[q][i] + self.latency(q, r)
        if when > t:
            self.visible(when, g)
            return False
        return self.run(g, t)

    def run(self, g: int, t: float) -> bool:
        """Step ``g``'s post is visible at ``t``: True if it is done now (a ``WAIT``)."""
        prog = self.prog
        if self.start_t is not None:
            self.start_t[g] = t
        k = prog.kind[g]
        if k == WAIT:
            return True
        r = prog.owner[g]
        busy = self.busy
        start = busy[r] if busy[r] > t else t
        busy[r] = end = start + prog.nbytes[g] * (self.delta[r] if k == GET else self.gamma[r])
        if self.start_t is not None:
            self.start_t[g] = start
        self.local_done(end, g)
        return False


def check_hosts(program: Program, hosts: tuple[int, ...]) -> None:
    """Refuse a one-sided step that names a rank on another host than its own (``hosts[r]``).

    Raises:
        ValueError: naming the first such step.
    """
    kind, peer, owner = program.kind, program.peer, program.owner
    n = len(hosts)
    for g, k in enumerate(kind):
        if k <= POST:  # messages, local work, posts: no peer's window
            continue
        q, r = peer[g], owner[g]
        if q < n and r < n and hosts[q] != hosts[r]:
            raise ValueError(
                f"rank {r} step {int(program.local[g])} ({describe(program, g)}) reads the "
                f"window of rank {q} on host {hosts[q]}; rank {r} is on host {hosts[r]}, and "
                "a window is shared by the ranks of one host only"
            )
