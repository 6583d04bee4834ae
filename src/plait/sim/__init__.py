"""plait.sim: run plait's own schedules on a modelled network, in virtual time.

::

    from plait import sim

    net = sim.fat_tree(1024, 32, sim.LinkParams(1e-6, 1 / 12.5e9), oversubscription=2)
    res = sim.simulate("allreduce", "ring", 64 << 20, net)
    res.time                     # seconds until the last rank finishes
    res.finish[17]               # when rank 17 finishes
    res.busiest_links(3)         # [(link name, bytes), ...]
    sim.write_trace(res, "ring.json")   # needs simulate(..., trace=True)

The simulator builds every rank's schedule with the same builder the
executor runs (:func:`plait.algos._registry.build_schedule`), so no collective
is re-implemented here, and interprets them with the executor's rules
(:mod:`plait.sim.engine`) on a network of links with latencies and shared
bandwidths (:mod:`plait.sim.network`). ``with_data=True`` moves real numpy
data through the same schedules and checks the result against
:func:`plait.testing.reference`.

The model, in short (details in :mod:`plait.sim.engine` and :mod:`plait.sim.network`):

* a message is a flow over its route's links; it arrives the route's latency
  after its last byte left; a send completes when its message has arrived;
* flows crossing a link share its bandwidth max-min fairly, recomputed at every
  instant at which a flow starts or ends; the messages from one rank to another
  go one after another (one ordered channel per pair, like plait's transports);
* copies cost δ and reductions γ seconds per byte, one at a time per rank;
* everything else follows the executor: dependencies, (src, dst, tag) matching,
  receive-and-reduce data that may arrive early.

In-network aggregation: on a network built with ``aggregation_memory`` the
switches can reduce in flight. For an algorithm that needs them
(``in_network``), :meth:`Network.aggregation_fabric` arranges them into a
tree, each switch becomes one more participant after the ranks (its schedule
built by the same algorithm file) and runs on its switch node; ``Result``
reports the ranks only.

On :func:`flat` networks without contention (``ports=False``) and without
pipelining, the simulated time equals the α-β-γ formulas of Thakur,
Rabenseifner and Gropp (2005) as rederived for plait's schedules
(:mod:`plait.sim.formulas`, asserted to 1e-9 by the tests for p = 1..33).

Run time
--------
Measured on the 2-core machine this repository is tested on (timing only,
flat network, 16 MiB, one segment, ``PLAIT_SIM_SCALE=full pytest
tests/sim/test_scale.py``; the machine is shared, and with other jobs running
the build took up to twice as long):

======================  ======  ==========  ======  ======  =====
allreduce               ranks   steps       build   engine  total
======================  ======  ==========  ======  ======  =====
ring                    1,024   4,191,232   22 s    8 s     30 s
recursive_doubling      16,384  475,136     2 s     2 s     4 s
swing                   16,384  933,888     29 s    5 s     34 s
double_binary_tree      16,384  147,448     1 s     1 s     2 s
======================  ======  ==========  ======  ======  =====

*Engine*: linear in the number of steps, about 2 µs per step (4 µs where every
message goes to a new pair of ranks, as in recursive doubling) and flat from
10^5 to 4·10^6 steps, because steps are numbered so that those handled at the
same instant sit together in memory and events of one instant share one
calendar entry. Each instant at which flows start or end costs, on top, the
flows whose share may change: none beyond the new ones when flows do not share
links (flat, rings, tori with nearest-neighbour traffic); with max-min sharing
on contended links, the whole group of flows connected through shared links,
so heavily contended networks with unsynchronised flows grow towards
quadratic in the number of concurrent flows (``sharing="equal"`` stays local).

*Build*: plait's builder costs about 5-10 µs per step, plus, for Swing, O(p) per
rank (it lists all p blocks on every rank: 2 ms per rank at 16,384 ranks, 33 s
of the build), and Rabenseifner even more (12 ms per rank, about 200 s at
16,384). Ranks are built in forked worker processes on every core for jobs
of 512 ranks and more (:func:`plait.sim.program.build_program`), and the
garbage collector is paused while building and simulating (twice as fast).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait import algos as _algos  # noqa: F401  (registers every algorithm)
from plait.algos._registry import REDUCING, build_schedule, get
from plait.ops import SUM, Op
from plait.schedule.builder import Context
from plait.schedule.ir import Schedule
from plait.sim.engine import SHARING, Data, Outcome, StepRecord, run, run_schedules
from plait.sim.model import LinkParams
from plait.sim.network import Network, Node, fat_tree, flat, hosts, ring, single_switch, torus
from plait.sim.program import Program, build_program
from plait.sim.trace import trace_events, write_trace

__all__ = [
    "BLOCK_COLLECTIVES",
    "SHARING",
    "LinkParams",
    "Network",
    "Node",
    "Program",
    "Result",
    "SimCheckError",
    "StepRecord",
    "build_all",
    "context_count",
    "fat_tree",
    "flat",
    "from_profile",
    "hosts",
    "ring",
    "run",
    "simulate",
    "simulate_schedules",
    "single_switch",
    "torus",
    "trace_events",
    "write_trace",
]

#: Collectives whose ``nbytes`` is the whole buffer of ``size`` blocks (nccl-tests' convention).
BLOCK_COLLECTIVES = frozenset({"reduce_scatter", "allgather", "alltoall", "gather", "scatter"})


class SimCheckError(AssertionError):
    """With data: a rank's result differs from the numpy reference."""


@dataclass
class Result:
    """The outcome of one simulated call.

    Attributes:
        collective, algorithm: what ran.
        size: number of ranks.
        count: ``Context.count`` of the call (elements; per-rank block for block collectives).
        nbytes: the collective's whole buffer in bytes (as in ``plait bench``).
        itemsize: bytes per element.
        time: seconds until the last rank finished.
        finish: per rank, when its last step finished.
        link_bytes: bytes that crossed each link of ``network`` (index = link index).
        network: the network it ran on.
        steps, messages, events: sizes of the simulation.
        build_seconds, sim_seconds: wall time spent building schedules and simulating.
        records: per-step timings when run with ``trace=True`` (see :func:`write_trace`).
        outputs: with data, every rank's flat ``OUT`` (None where it has none).
    """

    collective: str
    algorithm: str
    size: int
    count: int
    nbytes: int
    itemsize: int
    time: float
    finish: np.ndarray
    link_bytes: np.ndarray
    network: Network = field(repr=False)
    steps: int = 0
    messages: int = 0
    events: int = 0
    build_seconds: float = 0.0
    sim_seconds: float = 0.0
    records: list[StepRecord] | None = field(default=None, repr=False)
    outputs: list[np.ndarray | None] | None = field(default=None, repr=False)

    def busiest_links(self, k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` links that carried the most bytes: ``(name, bytes)``, most first."""
        order = np.argsort(-self.link_bytes, kind="stable")[:k]
        return [(self.network.link_name(int(i)), float(self.link_bytes[i])) for i in order]

    def bytes_by_class(self) -> dict[str, float]:
        """Bytes carried per link class (e.g. ``intra``, ``inter``, ``port``)."""
        out: dict[str, float] = {}
        for klass, b in zip(self.network.link_class, self.link_bytes, strict=True):
            out[klass] = out.get(klass, 0.0) + float(b)
        return out


def context_count(collective: str, nbytes: int, itemsize: int, size: int) -> int:
    """``Context.count`` for a whole buffer of ``nbytes`` (rounded down to whole blocks).

    ``nbytes`` follows ``plait bench`` and nccl-tests: the vector for allreduce,
    reduce and broadcast; the whole input of reduce_scatter and alltoall; the
    whole output of allgather and gather; root's whole input of scatter.
    """
    if collective == "barrier":
        return 0
    elements = nbytes // itemsize
    return elements // size if collective in BLOCK_COLLECTIVES else elements


def from_profile(
    profile: Any,
    size: int,
    *,
    ranks_per_host: int | None = None,
    nics: int = 1,
    ports: bool = True,
) -> Network:
    """The network a measured profile describes (:class:`plait.selection.model.Profile`).

    ``size`` ranks on one host (:func:`flat` with the profile's ``intra`` link),
    or, with ``ranks_per_host`` dividing ``size`` into several hosts and a
    profile that measured an ``inter`` link, :func:`hosts` joined by ``nics``
    NICs each. γ and δ are the profile's.
    """
    intra = LinkParams(profile.intra.alpha, profile.intra.beta)
    gamma, delta = profile.gamma, profile.delta
    if ranks_per_host is None or ranks_per_host >= size:
        return flat(size, intra.alpha, intra.beta, gamma, delta=delta, ports=ports)
    if profile.inter is None:
        raise ValueError("the profile has no inter-host link: measure one with plait tune")
    if size % ranks_per_host:
        raise ValueError(f"{size} ranks do not split into hosts of {ranks_per_host}")
    inter = LinkParams(profile.inter.alpha, profile.inter.beta)
    return hosts(
        size // ranks_per_host, ranks_per_host, intra, inter, nics=nics, gamma=gamma, delta=delta
    )


def build_all(
    collective: str,
    algorithm: str,
    size: int,
    count: int,
    *,
    itemsize: int = 4,
    root: int = 0,
    segment: int = 0,
    commutative: bool = True,
    network: Network | None = None,
) -> list[Schedule]:
    """Every rank's schedule, exactly as the executor would get it.

    For an algorithm that needs a fabric (``in_network``), the network's
    aggregating switches' schedules follow the ranks'.
    """
    spec = get(collective, algorithm)
    hosts_layout = network.host_layout() if network is not None else None
    fabric = None
    if spec.needs_fabric:
        if network is None:
            raise ValueError(f"{algorithm} needs a network with switches that reduce")
        fabric = network.aggregation_fabric()[0]
    ctx = Context(
        collective, 0, size, count, itemsize, commutative, root, segment, hosts_layout, fabric
    )
    return [build_schedule(spec, ctx.with_rank(r)) for r in range(ctx.participants)]


def simulate(
    collective: str,
    algorithm: str,
    nbytes: int,
    network: Network,
    *,
    dtype: Any = np.float32,
    root: int = 0,
    segment_bytes: int | None = 0,
    op: Op | None = None,
    with_data: bool = False,
    inputs: Sequence[np.ndarray | None] | None = None,
    sharing: str = "maxmin",
    trace: bool = False,
    seed: int = 0,
    workers: int | None = None,
) -> Result:
    """Simulate one call of ``collective`` with ``algorithm`` on every rank of ``network``.

    Args:
        collective, algorithm: as in ``plait.algorithms(collective)``.
        nbytes: the collective's whole buffer (see :func:`context_count`).
        network: a topology from this package; its size is the number of ranks.
        dtype: element type (sets the element size; with data, the arrays' type).
        root: for rooted collectives.
        segment_bytes: pipelining unit, as ``Context.segment`` in bytes; 0: unsegmented;
            None: what the communicator uses (``plait.selection.select.SEGMENT_BYTES``).
        op: the reduction (default SUM); its commutativity picks the schedule.
        with_data: move real data and check every rank's result against the reference.
        inputs: with data, per rank ``x`` as the communicator call would take it (flat);
            default: reproducible random values from ``seed``.
        sharing: ``"maxmin"`` or ``"equal"`` bandwidth sharing (:mod:`plait.sim.engine`).
        trace: keep per-step timings for :func:`write_trace`.
        seed: seeds the random inputs of ``with_data``.
        workers: processes that build the schedules (None: all cores for big
            jobs, see :func:`plait.sim.program.build_program`; 1: this one).

    Raises:
        ValueError: bad arguments (unknown algorithm, op not allowed by it, ...).
        SimCheckError: with data, a result that differs from the reference.
    """
    dt = np.dtype(dtype)
    op = op if op is not None else SUM
    spec = get(collective, algorithm)
    if not spec.supports(commutative=op.commutative, fabric=True):
        raise ValueError(f"{collective}/{algorithm} needs a commutative op; {op!r} is not")
    p = network.size
    fabric, run_on = None, network
    if spec.needs_fabric:  # the aggregating switches become participants after the ranks
        fabric, nodes = network.aggregation_fabric()
        run_on = network.with_agents(nodes)
    count = context_count(collective, nbytes, dt.itemsize, p)
    if segment_bytes is None:
        from plait.selection.select import SEGMENT_BYTES

        segment_bytes = SEGMENT_BYTES
    segment = max(1, segment_bytes // dt.itemsize) if segment_bytes else 0
    t0 = time.perf_counter()
    program = build_program(
        collective,
        algorithm,
        p,
        count,
        itemsize=dt.itemsize,
        root=root,
        segment=segment,
        commutative=op.commutative,
        hosts=network.host_layout(),
        fabric=fabric,
        workers=workers,
        keep_schedules=with_data,
    )
    built = time.perf_counter() - t0
    data = None
    xs: list[np.ndarray | None] = []
    if with_data:
        assert program.schedules is not None
        xs = _inputs(collective, p, count, dt, root, inputs, seed)
        data = _buffers(collective, program.schedules, xs, dt, root, op)
    out = run(program, run_on, sharing=sharing, data=data, record=trace)
    whole = count * p if collective in BLOCK_COLLECTIVES else count
    result = _result(
        collective, algorithm, p, count, whole * dt.itemsize, dt.itemsize, network, out
    )
    result.build_seconds = built
    if with_data:
        assert program.schedules is not None
        result.outputs = _check(collective, program.schedules, out, xs, op, root, p)
    return result


def simulate_schedules(
    schedules: Sequence[Schedule],
    network: Network,
    itemsize: int,
    *,
    sharing: str = "maxmin",
    trace: bool = False,
) -> Result:
    """Time arbitrary schedules (one per rank), e.g. several collectives' built by hand."""
    out = run_schedules(schedules, network, itemsize, sharing=sharing, record=trace)
    return _result("custom", "custom", len(schedules), 0, 0, itemsize, network, out)


def _result(
    collective: str,
    algorithm: str,
    p: int,
    count: int,
    nbytes: int,
    itemsize: int,
    network: Network,
    out: Outcome,
) -> Result:
    return Result(
        collective=collective,
        algorithm=algorithm,
        size=p,
        count=count,
        nbytes=nbytes,
        itemsize=itemsize,
        time=max(out.finish[:p], default=0.0),
        finish=np.asarray(out.finish[:p], dtype=np.float64),
        link_bytes=np.asarray(out.link_bytes, dtype=np.float64),
        network=network,
        steps=out.steps,
        messages=out.messages,
        events=out.events,
        sim_seconds=out.seconds,
        records=out.records,
    )


# -- with data -----------------------------------------------------------------------------


def _inputs(
    collective: str,
    p: int,
    count: int,
    dt: np.dtype,
    root: int,
    given: Sequence[np.ndarray | None] | None,
    seed: int,
) -> list[np.ndarray | None]:
    """Each rank's ``x`` as the communicator takes it (flat); random unless given."""
    n = {"reduce_scatter": p * count, "alltoall": p * count, "scatter": p * count}.get(
        collective, count
    )
    if collective == "barrier":
        return [None] * p
    if given is not None:
        if len(given) != p:
            raise ValueError(f"inputs: {len(given)} arrays for {p} ranks")
        xs: list[np.ndarray | None] = []
        for r, x in enumerate(given):
            if x is None:
                xs.append(None)
                continue
            a = np.ascontiguousarray(np.asarray(x, dtype=dt)).reshape(-1)
            if a.size != n:
                raise ValueError(f"inputs[{r}] has {a.size} elements; the call needs {n}")
            xs.append(a)
        return xs
    rng = np.random.default_rng(seed)
    out: list[np.ndarray | None] = []
    for _ in range(p):
        if dt.kind == "b":
            out.append(rng.integers(0, 2, n).astype(dt))
        elif dt.kind in "iu":
            out.append(rng.integers(0, 100, n).astype(dt))
        else:  # small integers stay exact whatever order a float sum takes
            out.append(rng.integers(-8, 9, n).astype(dt))
    return out


def _buffers(
    collective: str,
    schedules: Sequence[Schedule],
    xs: list[np.ndarray | None],
    dt: np.dtype,
    root: int,
    op: Op,
) -> Data:
    bufs = []
    for r, s in enumerate(schedules):
        x = xs[r] if r < len(xs) else None  # a fabric's switches have no input
        inp = np.zeros(s.in_count, dt)
        if s.in_count and x is not None:
            inp[...] = x
        if collective == "broadcast":
            out = (
                np.array(x, dtype=dt) if r == root and x is not None else np.zeros(s.out_count, dt)
            )
        else:
            out = np.zeros(s.out_count, dt)
        bufs.append((inp, out, np.zeros(s.tmp_count, dt)))
    return Data(bufs, op.ufunc if collective in REDUCING else np.bitwise_or)


def _check(
    collective: str,
    schedules: Sequence[Schedule],
    out: Outcome,
    xs: list[np.ndarray | None],
    op: Op,
    root: int,
    p: int,
) -> list[np.ndarray | None]:
    from plait.testing import reference

    assert out.buffers is not None
    results: list[np.ndarray | None] = []
    for r in range(p):
        o = out.buffers[r][1]
        if collective in REDUCING and op.average and o.size:
            with np.errstate(all="ignore"):
                np.divide(o, p, out=o)
        results.append(o)
    if collective in ("broadcast", "scatter") and xs[root] is None:
        raise ValueError("with data: the root needs an input")
    want = reference(collective, xs, op=op if collective in REDUCING else None, root=root)
    for r in range(p):
        w, got = want[r], results[r]
        if w is None:
            results[r] = None
            continue
        w = np.asarray(w).reshape(-1)
        if got is None or got.shape != w.shape:
            raise SimCheckError(f"{collective}: rank {r} has no output of {w.size} elements")
        exact = got.dtype.kind in "biu" or op.name in ("min", "max", "minimum", "maximum")
        ok = np.array_equal(got, w) if exact else np.allclose(got, w, rtol=1e-5, atol=1e-6)
        if not ok:
            bad = int(np.flatnonzero(got != w)[0]) if got.size else 0
            raise SimCheckError(
                f"{collective}: rank {r} OUT[{bad}] = {got[bad]!r}, expected {w[bad]!r}"
            )
    if collective == "allreduce":
        first = results[0]
        for r in range(1, p):
            if not np.array_equal(results[r], first):  # type: ignore[arg-type]
                raise SimCheckError(f"allreduce: rank {r}'s result differs from rank 0's")
    return results
