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
bandwidths (:mod:`plait.sim.network`, ready-made ones in
:mod:`plait.sim.topologies`). ``with_data=True`` moves real numpy data through
the same schedules and checks the result against the numpy reference of the
table of collectives (:func:`plait.collectives.reference`, also
``plait.testing.reference``; :mod:`plait.sim.data`).

The model, in short (details in :mod:`plait.sim.engine` and :mod:`plait.sim.network`):

* a message is a flow over its route's links; it arrives the route's latency
  after its last byte left; a send completes when its message has arrived;
* flows crossing a link share its bandwidth max-min fairly, recomputed at every
  instant at which a flow starts or ends; the messages from one rank to another
  go one after another (one ordered channel per pair, like plait's transports);
* copies cost δ and reductions γ seconds per byte, one at a time per rank
  (for every algorithm: a ring's receive-and-reduce as an arena's get-and-reduce);
* one-sided steps: a post is visible to a peer the network's wait latency
  (:meth:`Network.set_wait_latency`; unset: a message's latency) later, and
  a get costs what a copy (a get-and-reduce: a reduction) of its bytes does
  once the post it needs is visible (:mod:`plait.sim.onesided`); a mixed
  schedule (messages between hosts, one-sided steps within each) is charged
  both ways in one run;
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
Rabenseifner and Gropp (2005) as rederived for plait's schedules (each on its
algorithm's registration, ``AlgorithmSpec.cost``; :mod:`plait.sim.formulas`
looks them up; asserted to 1e-9 by the tests for p = 1..33).

Modules: :mod:`plait.sim.call` (:func:`simulate` and its :class:`Result`),
:mod:`plait.sim.program` (schedules compiled to flat arrays),
:mod:`plait.sim.engine` (the discrete-event run; its one-sided steps in
:mod:`plait.sim.onesided`), :mod:`plait.sim.network`
and :mod:`plait.sim.topologies` (the modelled networks),
:mod:`plait.sim.data` (with data), :mod:`plait.sim.trace` (Chrome traces).

Run time
--------
Measured on the 2-core machine this repository is tested on (timing only,
flat network, 64 MiB, ``PLAIT_SIM_SCALE=full pytest -s tests/sim/test_scale.py``;
the machine is shared, and with other jobs running a run took up to twice
as long):

======================  ======  ==========  ======  ======  =====
allreduce               ranks   steps       build   engine  total
======================  ======  ==========  ======  ======  =====
ring                    1,024   4,191,232   5 s     5 s     10 s
recursive_doubling      16,384  475,136     0.5 s   1 s     1.5 s
swing                   16,384  933,888     3 s     2.5 s   6 s
rabenseifner            16,384  933,888     2 s     2 s     4 s
double_binary_tree      16,384  147,448     0.5 s   0.5 s   1 s
======================  ======  ==========  ======  ======  =====

*Engine*: linear in the number of steps, about 1 µs per step (2 µs where every
message goes to a new pair of ranks, as in recursive doubling) and flat from
10^5 to 4·10^6 steps, because steps are numbered so that those handled at the
same instant sit together in memory and events of one instant share one
calendar entry. Each instant at which flows start or end costs, on top, the
flows whose share may change: none beyond the new ones when flows do not share
links (flat, rings, tori with nearest-neighbour traffic); with max-min sharing
on contended links, the whole group of flows connected through shared links,
so heavily contended networks with unsynchronised flows grow towards
quadratic in the number of concurrent flows (``sharing="equal"`` stays local;
:mod:`plait.sim.sharing` finds the shares).

*Build*: about 1 µs per step, whatever the number of ranks. A step is recorded
as a row of its fields and read by the engine as columns, never made into an
object (Note [recorded rows] in :mod:`plait.schedule.builder`); its
dependencies are found by looking up the pieces of memory it touches, most
often exactly one (Note [hazard pieces] in :mod:`plait.schedule.hazards`);
and what every rank lists alike about the call (the p blocks of the vector, a
folded group's virtual ranks) is made once, not once per rank (Note [lists
every rank makes] in :mod:`plait.schedule.cuts`). Before these, ring on
1,024 ranks took 22 s to build, Swing 29 s and Rabenseifner about 200 s on
16,384 ranks. Ranks are built in forked worker processes on every core for
jobs of 512 ranks and more (:func:`plait.sim.program.build_program`), and the
garbage collector is paused while building and simulating (twice as fast).
"""

from __future__ import annotations

from plait.sim.call import (
    BLOCK_COLLECTIVES,
    MAX_BYTES,
    Result,
    build_all,
    context_count,
    simulate,
    simulate_schedules,
)
from plait.sim.data import SimCheckError
from plait.sim.engine import SHARING, StepRecord, run
from plait.sim.model import LinkParams
from plait.sim.network import Network, Node
from plait.sim.program import Program
from plait.sim.topologies import fat_tree, flat, from_profile, hosts, ring, single_switch, torus
from plait.sim.trace import trace_events, write_trace

__all__ = [
    "BLOCK_COLLECTIVES",
    "MAX_BYTES",
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
