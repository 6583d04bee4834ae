"""The discrete-event simulation: every rank's schedule, run together on a modelled network.

It interprets :class:`~plait.schedule.ir.Schedule` objects exactly as
:mod:`plait.runtime.executor` does, with time instead of a transport:

* a step starts when all its ``deps`` have finished;
* ``SEND`` hands its message to the channel from its rank to the peer at
  once; the k-th send from a to b meets the k-th receive at b from a
  (``tag``). A channel carries one message at a time, in send order (as a
  TCP connection or a shared-memory ring does), so the segments of a
  pipelined message follow each other instead of sharing the wire;
* ``RECV`` finishes when it has started and its message has arrived (data may
  arrive before the receive is posted: transports buffer it);
* ``RECV_REDUCE`` is posted at the start (as the executor posts it into
  staging memory), so its data may arrive early; the reduction runs once both
  the data and the dependencies are there;
* ``COPY``, ``REDUCE`` and the reduction of ``RECV_REDUCE`` are a rank's local
  work: they cost δ (copy) or γ (reduce) seconds per byte and run one at a
  time per rank, in the order they become ready;
* the one-sided steps (``POST``, ``WAIT``, ``GET``, ``GET_REDUCE``) are charged
  as :mod:`plait.sim.onesided` says: a post is free and seen by a peer after
  the wait latency; a ``GET``/``GET_REDUCE`` waits for it and then
  costs what a ``COPY``/``REDUCE`` of its bytes would. A mixed program has
  both kinds (messages between hosts, one-sided steps within each): each is
  charged as it would be alone, in the order its dependencies give.

Messages are fluid flows (:mod:`plait.sim.network`): a flow streams its bytes
at a rate that the network assigns, and arrives its path's latency after its
last byte left. A send finishes when its message has arrived (delivery, as a
network completion reports it), which is also when its receive may finish.
Each link's bandwidth is shared among the flows on it, recomputed whenever a
flow starts or ends (:mod:`plait.sim.sharing`): ``"maxmin"`` (default) is
max-min fair sharing over the links that interact (progressive filling),
``"equal"`` gives each flow the smallest equal share of its links (cheaper and
local, not work-conserving).
Events at the same instant are handled as a batch, so the rates are
recomputed once per instant however many flows start or end in it.

In timing-only mode nothing moves but time. With data, every rank gets real
numpy buffers and the steps move and reduce them: a send reads its region
when it completes, so a schedule that overwrites data still in flight gets
caught by the result check.

Run time: a constant amount of work per step and per message, plus, per
instant, the flows whose rates may change (see :mod:`plait.sim` for
measurements). Steps are kept in flat lists indexed by a global step id
(:mod:`plait.sim.program`), events are integers (an id and a code) filed
under their instant in a calendar (a heap of distinct times, a list per
time), and Python's cyclic garbage collector is paused while it runs.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.schedule.ir import Schedule, StepKind
from plait.sim.network import Network
from plait.sim.onesided import OneSided
from plait.sim.program import COPY as _COPY
from plait.sim.program import GET as _GET
from plait.sim.program import GET_REDUCE as _GET_REDUCE
from plait.sim.program import POST as _POST
from plait.sim.program import RECV as _RECV
from plait.sim.program import RECV_REDUCE as _RECV_REDUCE
from plait.sim.program import SEND as _SEND
from plait.sim.program import Program, compile_schedules, describe, no_gc
from plait.sim.sharing import shares

__all__ = ["Data", "Outcome", "StepRecord", "run", "run_schedules"]

# Event codes, in the low two bits of an event.
_FLOW_DONE = 0
_ARRIVE = 1
_LOCAL_DONE = 2
_VISIBLE = 3  # a one-sided step's post is visible to it now

SHARING = ("maxmin", "equal")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """When one step ran (for traces).

    ``ready`` is when its dependencies were done (for a send, when its flow
    started; for a receive, when it was posted); ``start`` is when its local work
    began (local steps and reductions) or ``ready``; ``end`` is when it finished.
    """

    rank: int
    index: int
    kind: StepKind
    peer: int
    tag: int
    nbytes: int
    ready: float
    start: float
    end: float


@dataclass
class Outcome:
    """What :func:`run_schedules` returns."""

    time: float
    finish: list[float]
    link_bytes: list[float]
    steps: int
    messages: int
    events: int
    seconds: float
    records: list[StepRecord] | None = None
    buffers: list[tuple[np.ndarray, ...]] | None = field(default=None, repr=False)


class Data:
    """Real buffers for the with-data mode: per rank ``(IN, OUT, TMP, SHARED)`` and the op.

    A rank given only ``(IN, OUT, TMP)`` gets an empty ``SHARED``.
    """

    def __init__(
        self, buffers: Sequence[tuple[np.ndarray, ...]], ufunc: Callable[..., object] | None
    ) -> None:
        self.buffers: list[tuple[np.ndarray, ...]] = [
            b if len(b) > 3 else (*b, np.empty(0, b[1].dtype)) for b in buffers
        ]
        self.ufunc = ufunc


def run_schedules(
    schedules: Sequence[Schedule],
    network: Network,
    itemsize: int,
    *,
    sharing: str = "maxmin",
    data: Data | None = None,
    record: bool = False,
) -> Outcome:
    """Simulate ``schedules`` (one per rank, rank order) on ``network``; see :func:`run`."""
    return run(
        compile_schedules(schedules, itemsize), network, sharing=sharing, data=data, record=record
    )


def run(
    program: Program,
    network: Network,
    *,
    sharing: str = "maxmin",
    data: Data | None = None,
    record: bool = False,
) -> Outcome:
    """Simulate a compiled :class:`~plait.sim.program.Program` on ``network``.

    Args:
        program: every rank's steps.
        network: where they run; ``network.size`` must equal the number of ranks.
        sharing: ``"maxmin"`` or ``"equal"`` (see the module docstring).
        data: buffers to move real data through (None: timing only); needs a
            program that kept its schedules.
        record: keep a :class:`StepRecord` per step (for traces).

    Raises:
        ValueError: mismatched sizes or an unknown ``sharing``.
        RuntimeError: the schedules deadlock.
    """
    if sharing not in SHARING:
        raise ValueError(f"sharing must be one of {SHARING}; got {sharing!r}")
    if network.size != program.size:
        raise ValueError(f"{program.size} ranks' schedules on a network of {network.size} ranks")
    if data is not None and program.schedules is None:
        raise ValueError("moving data needs the schedules: compile them in this process")
    wall = time.perf_counter()
    with no_gc():
        sim = _Sim(program, network, sharing == "maxmin", data, record)
        sim.loop()
        return sim.outcome(time.perf_counter() - wall)


class _Sim:
    """State of one simulation; per-step state lives in flat lists indexed by global step id."""

    def __init__(
        self, program: Program, net: Network, maxmin: bool, data: Data | None, record: bool
    ) -> None:
        self.prog = program
        self.net = net
        self.p = program.size
        self.n = program.n_steps
        self.maxmin = maxmin
        self.data = data
        self.record = record
        self.left = list(program.n_deps)
        self.ready_t = [0.0] * self.n if record else []
        self.start_t = [0.0] * self.n if record else []
        self.end_t = [0.0] * self.n if record else []
        self.finish = [0.0] * self.p
        self.events = 0
        self.cap = [math.inf if b == 0 else 1.0 / b for b in net.link_beta]
        self.lat = net.link_latency
        self.all_finite = math.inf not in self.cap
        # Every flow's own speed limit (bytes/s); inf: only the links limit it.
        self.flow_cap = math.inf if net.message_beta == 0 else 1.0 / net.message_beta
        self.link_flows: list[set[int]] = [set() for _ in range(net.n_links)]
        self.posted = bytearray(self.n)
        self.arrived = bytearray(self.n)
        # route key (src * p + dst) -> (links that limit bandwidth, latency, all links, the
        # rate of a flow alone on them)
        self.routes: dict[int, tuple[tuple[int, ...], float, tuple[int, ...], float]] = {}
        self.route_bytes: dict[int, int] = {}
        self.shared: OneSided | None = None

    def _route(self, src: int, dst: int) -> tuple[tuple[int, ...], float, tuple[int, ...], float]:
        """(links that limit bandwidth, total latency, all links, the rate of a flow alone on
        them: its slowest link's speed or its own limit) from rank src to rank dst."""
        path = self.net.route(src, dst)
        cap = self.cap
        limited = path if self.all_finite else tuple([i for i in path if cap[i] != math.inf])
        alone = min(min(map(cap.__getitem__, limited)), self.flow_cap) if limited else math.inf
        return limited, self.net.message_alpha + sum(map(self.lat.__getitem__, path)), path, alone

    # -- the event loop ----------------------------------------------------------------
    def loop(self) -> None:
        """Run to the end. An event is ``id << 2 | code``: a flow's or a step's id, and what."""
        prog = self.prog
        kind, peer, nbytes, owner = prog.kind, prog.peer, prog.nbytes, prog.owner
        dep_ptr, dep_idx, match = prog.dep_ptr, prog.dep_idx, prog.match
        left = self.left
        p = self.p
        gamma, delta = self.net.gamma, self.net.delta
        msg_beta = self.net.message_beta
        finish = self.finish
        routes, route_bytes = self.routes, self.route_bytes
        link_flows = self.link_flows
        record = self.record
        ready_t, start_t, end_t = self.ready_t, self.start_t, self.end_t
        data = self.data
        # The event calendar: a heap of distinct times, and the events of each time in
        # the order they were scheduled. Lock-step algorithms put thousands of events
        # on one instant, which then cost a list append each instead of a heap push.
        times: list[float] = []
        calendar: dict[float, list[int]] = {}
        heappush, heappop = heapq.heappush, heapq.heappop
        events = 0
        busy = [0.0] * p  # when each rank's local work queue drains
        posted = self.posted  # receive: its dependencies are done
        arrived = self.arrived  # receive: its message has arrived
        # Per flow: [bytes left, at time, rate, links, latency, send step, end, channel,
        # rate alone].
        flows: list[list[Any]] = []
        self.flows = flows
        # Messages from a to b go one after another (one ordered channel per pair, as
        # plait's transports have): channel -> messages waiting behind the one in flight.
        waiting: dict[int, list[int]] = {}
        channel_free: dict[int, float] = {}  # channels of link-free routes: when idle again
        new_flows: list[int] = []
        dirty: set[int] = set()  # links whose flows changed at this instant (and still have some)

        def push(when: float, ev: int) -> None:
            bucket = calendar.get(when)
            if bucket is None:
                calendar[when] = [ev]
                heappush(times, when)
            else:
                bucket.append(ev)

        if prog.one_sided:  # posts and what waits for them (mixed too): plait.sim.onesided
            self.shared = OneSided(
                prog,
                self.net,
                lambda q, r: self._route(q, r)[1],
                lambda when, g: push(when, g << 2 | _VISIBLE),
                lambda when, g: push(when, g << 2 | _LOCAL_DONE),
                busy,
                start_t if record else None,
            )
        shared = self.shared
        staged: dict[int, np.ndarray] = {}  # with data: RECV_REDUCE step -> its arrived data
        pending: dict[int, np.ndarray] = {}  # with data: RECV step -> data that came early
        n_done = 0
        t = 0.0
        # Steps ready at this instant, handled first in, first out (as the executor's deque).
        ready: list[int] = [g for g in range(self.n) if left[g] == 0]
        while True:
            # ---- start everything that is ready at time t -------------------------------
            i_ready = 0
            while i_ready < len(ready):
                g = ready[i_ready]
                i_ready += 1
                k = kind[g]
                if record:
                    ready_t[g] = start_t[g] = t
                if k == _SEND:
                    key = owner[g] * p + peer[g]
                    route = routes.get(key)
                    if route is None:
                        route = routes[key] = self._route(owner[g], peer[g])
                        route_bytes[key] = nbytes[g]
                    else:
                        route_bytes[key] += nbytes[g]
                    f = len(flows)
                    flows.append([nbytes[g], t, 0.0, route[0], route[1], g, 0.0, key, route[3]])
                    if not route[0]:  # shares no link: its own speed limit, in channel order
                        start = channel_free.get(key, t)
                        if start < t:
                            start = t
                        channel_free[key] = done = start + nbytes[g] * msg_beta
                        when = done + route[1]
                        bucket = calendar.get(when)
                        if bucket is None:
                            calendar[when] = [f << 2 | _ARRIVE]
                            heappush(times, when)
                        else:
                            bucket.append(f << 2 | _ARRIVE)
                    elif key in waiting:  # the channel is busy: wait in line
                        waiting[key].append(f)
                    else:
                        waiting[key] = []
                        new_flows.append(f)
                    continue
                if k == _RECV:
                    posted[g] = 1
                    if not arrived[g]:
                        continue
                    if data is not None:
                        self._write(g, pending.pop(g))
                elif k == _RECV_REDUCE:
                    posted[g] = 1
                    if arrived[g]:
                        r = owner[g]
                        start = busy[r] if busy[r] > t else t
                        busy[r] = end = start + nbytes[g] * gamma[r]
                        if record:
                            start_t[g] = start
                        when = end
                        bucket = calendar.get(when)
                        if bucket is None:
                            calendar[when] = [g << 2 | _LOCAL_DONE]
                            heappush(times, when)
                        else:
                            bucket.append(g << 2 | _LOCAL_DONE)
                    continue
                elif k >= _POST:  # one-sided steps
                    assert shared is not None
                    if k == _POST:
                        shared.post(g, t)
                    elif not shared.begin(g, t):
                        continue
                else:  # COPY, REDUCE: local work
                    r = owner[g]
                    start = busy[r] if busy[r] > t else t
                    end = start + nbytes[g] * (delta[r] if k == _COPY else gamma[r])
                    if record:
                        start_t[g] = start
                    if end != t:
                        busy[r] = end
                        when = end
                        bucket = calendar.get(when)
                        if bucket is None:
                            calendar[when] = [g << 2 | _LOCAL_DONE]
                            heappush(times, when)
                        else:
                            bucket.append(g << 2 | _LOCAL_DONE)
                        continue
                    if data is not None:  # free local work: done now
                        self._local(g, None)
                # The step finished at t (a receive whose data was there, or free work).
                n_done += 1
                if record:
                    end_t[g] = t
                r = owner[g]
                if t > finish[r]:
                    finish[r] = t
                for j in dep_idx[dep_ptr[g] : dep_ptr[g + 1]]:
                    left[j] -= 1
                    if left[j] == 0:
                        ready.append(j)
            ready.clear()
            # ---- the instant is over: install new flows and recompute shares ------------
            if new_flows or dirty:
                self._reshare(t, dirty, new_flows, times, calendar)
                new_flows.clear()
                dirty.clear()
            if not times:
                break
            # ---- advance to the next instant and take all its events --------------------
            # (Events scheduled for t from here on get a new bucket, handled next round.)
            t = heappop(times)
            for ev in calendar.pop(t):
                events += 1
                code = ev & 3
                x = ev >> 2
                if code == _FLOW_DONE:
                    flow = flows[x]
                    if flow is None or flow[6] != t:
                        continue  # superseded: the flow's rate changed since
                    flow[6] = -1.0
                    for i in flow[3]:
                        on = link_flows[i]
                        on.discard(x)
                        if on:
                            dirty.add(i)
                    when = t + flow[4]
                    bucket = calendar.get(when)
                    if bucket is None:
                        calendar[when] = [x << 2 | _ARRIVE]
                        heappush(times, when)
                    else:
                        bucket.append(x << 2 | _ARRIVE)
                    line = waiting[flow[7]]
                    if line:  # the next message of this channel starts now
                        nxt = line.pop(0)
                        flows[nxt][1] = t
                        new_flows.append(nxt)
                    else:
                        del waiting[flow[7]]
                    continue
                if code == _LOCAL_DONE:
                    if data is not None:
                        self._local(x, staged.pop(x, None))
                    done_now: tuple[int, ...] = (x,)
                elif code == _VISIBLE:
                    assert shared is not None
                    if not shared.run(x, t):
                        continue
                    done_now = (x,)
                else:  # _ARRIVE: the message is there; the send is complete
                    g = flows[x][5]
                    flows[x] = None  # type: ignore[call-overload]  # done with it
                    rg = match[g]
                    payload = self._read(g) if data is not None else None
                    arrived[rg] = 1
                    done_now = (g,)
                    if kind[rg] == _RECV:
                        if posted[rg]:
                            if data is not None:
                                self._write(rg, payload)  # type: ignore[arg-type]
                            done_now = (g, rg)
                        elif data is not None:
                            pending[rg] = payload  # type: ignore[assignment]
                    else:
                        if data is not None:
                            staged[rg] = payload  # type: ignore[assignment]
                        if posted[rg]:
                            r = owner[rg]
                            start = busy[r] if busy[r] > t else t
                            busy[r] = end = start + nbytes[rg] * gamma[r]
                            if record:
                                start_t[rg] = start
                            when = end
                            bucket = calendar.get(when)
                            if bucket is None:
                                calendar[when] = [rg << 2 | _LOCAL_DONE]
                                heappush(times, when)
                            else:
                                bucket.append(rg << 2 | _LOCAL_DONE)
                for g in done_now:
                    n_done += 1
                    if record:
                        end_t[g] = t
                    r = owner[g]
                    if t > finish[r]:
                        finish[r] = t
                    for j in dep_idx[dep_ptr[g] : dep_ptr[g + 1]]:
                        left[j] -= 1
                        if left[j] == 0:
                            ready.append(j)
        self.events = events
        if n_done != self.n:
            self._deadlock(n_done)

    # -- bandwidth sharing -------------------------------------------------------------
    def _reshare(
        self,
        t: float,
        dirty: set[int],
        new_flows: list[int],
        times: list[float],
        calendar: dict[float, list[int]],
    ) -> None:
        """Give every flow whose share may have changed at ``t`` its new rate and finish time."""
        flows = self.flows
        rates = shares(
            dirty, new_flows, flows, self.link_flows, self.cap, self.flow_cap, self.maxmin
        )
        for f, rate in rates.items():
            flow = flows[f]
            old = flow[2]
            if rate == old:
                continue
            if old > 0.0:
                rem = flow[0] - old * (t - flow[1])
                flow[0] = rem if rem > 0.0 else 0.0
            flow[1] = t
            flow[2] = rate
            flow[6] = end = t + flow[0] / rate
            bucket = calendar.get(end)
            if bucket is None:
                calendar[end] = [f << 2 | _FLOW_DONE]
                heapq.heappush(times, end)
            else:
                bucket.append(f << 2 | _FLOW_DONE)

    # -- with data ---------------------------------------------------------------------
    def _step(self, g: int) -> tuple[int, object]:
        r = self.prog.owner[g]
        assert self.prog.schedules is not None
        return r, self.prog.schedules[r].steps[int(self.prog.local[g])]

    def _region(self, g: int, which: str) -> np.ndarray:
        assert self.data is not None
        r, step = self._step(g)
        reg = getattr(step, which)
        if which == "src" and self.prog.kind[g] in (_GET, _GET_REDUCE):
            r = self.prog.peer[g]  # a get reads the peer's window
        buf: np.ndarray = self.data.buffers[r][reg.buf]
        return buf[reg.offset : reg.end]

    def _read(self, g: int) -> np.ndarray:
        return self._region(g, "src").copy()

    def _write(self, g: int, payload: np.ndarray) -> None:
        self._region(g, "dst")[...] = payload

    def _local(self, g: int, staged: np.ndarray | None) -> None:
        assert self.data is not None
        _, step = self._step(g)
        first = step.first  # type: ignore[attr-defined]
        ufunc = self.data.ufunc
        dst = self._region(g, "dst")
        k = self.prog.kind[g]
        if k == _RECV_REDUCE:
            assert staged is not None
            assert ufunc is not None
            if first:
                ufunc(staged, dst, out=dst)
            else:
                ufunc(dst, staged, out=dst)
            return
        src = self._region(g, "src")
        if k in (_COPY, _GET):
            dst[...] = src.copy() if np.shares_memory(src, dst) else src
            return
        assert ufunc is not None
        if first:
            ufunc(src, dst, out=dst)
        else:
            ufunc(dst, src, out=dst)

    # -- results -----------------------------------------------------------------------
    def _deadlock(self, n_done: int) -> None:
        prog = self.prog
        first: dict[int, int] = {}  # rank -> its first step that never finished
        for g in range(self.n):
            waiting = prog.kind[g] in (_RECV, _RECV_REDUCE) and not self.arrived[g]
            waiting = waiting or (self.shared is not None and g in self.shared.stuck)
            r = prog.owner[g]
            if (self.left[g] > 0 or waiting) and (r not in first or g < first[r]):
                first[r] = g
        stuck = [
            f"rank {r} step {int(prog.local[g])} ({describe(prog, g)})"
            for r, g in sorted(first.items())[:8]
        ]
        raise RuntimeError(
            f"deadlock: {self.n - n_done} of {self.n} steps never finish; first stuck: "
            + "; ".join(stuck)
        )

    def outcome(self, seconds: float) -> Outcome:
        """Collect the results."""
        prog = self.prog
        link_bytes = [0.0] * self.net.n_links
        for key, b in self.route_bytes.items():
            for i in self.routes[key][2]:
                link_bytes[i] += b
        records = None
        if self.record:
            kinds = list(StepKind)
            records = [
                StepRecord(
                    prog.owner[g],
                    int(prog.local[g]),
                    kinds[prog.kind[g]],
                    prog.peer[g],
                    prog.tag[g],
                    prog.nbytes[g],
                    self.ready_t[g],
                    self.start_t[g],
                    self.end_t[g],
                )
                for g in range(self.n)
            ]
        return Outcome(
            time=max(self.finish, default=0.0),
            finish=self.finish,
            link_bytes=link_bytes,
            steps=self.n,
            messages=prog.kind.count(_SEND),
            events=self.events,
            seconds=seconds,
            records=records,
            buffers=self.data.buffers if self.data is not None else None,
        )
