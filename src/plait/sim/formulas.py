"""Closed-form α-β-γ costs of plait's schedules on the flat network, after Thakur et al. (2005).

Each function gives the time of one call on :func:`plait.sim.flat` with
``ports=False`` (every message costs α + nβ, whatever else is in flight),
without pipelining (one segment), with γ seconds per byte reduced and δ per
byte copied, for ``p`` ranks and a buffer of ``n`` bytes (the collective's
whole buffer, as :func:`plait.sim.context_count` reads it). Blocks are assumed
equal: the element count divides evenly among the ranks (and among the
``q = pof2_floor(p)`` virtual ranks where an algorithm folds).

They are the formulas of Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH" (IJHPCA 19(1), 2005), rederived
for what plait's schedules actually do. Where they differ, the function says
why; the differences come from four things the paper's model does not have:

* **Local copies** (δ). plait copies the input into the output (or scratch)
  before reducing in place, and copies results out of scratch; the paper's
  algorithms copy nothing. With δ = 0 the formulas reduce to the paper's
  wherever the schedules otherwise agree.
* **Concurrent messages.** The paper's processes send one message at a time
  (blocking sends in a fixed order). plait's schedules only order what data
  dependencies order, so a rank may have several messages in flight (binomial
  broadcast, pairwise exchange, Bruck's short last step): their latencies
  overlap, so it is paid once, not once per message. Contention-free, they do
  not slow each other at all; with ports they share the rank's port, and the
  bandwidth term counts every byte through the busiest port.
* **Early data.** A receive-and-reduce accepts its message before its
  dependencies are done (as the executor stages it), so a rank that starts
  late catches up on partners that started early; only the longest chain of
  dependent messages counts (a max over paths, written out below).
* **Folding.** For p not a power of two the first ``2(p - q)`` ranks pair up and
  fold into ``q`` virtual ranks (Thakur et al.'s scheme for allreduce);
  plait folds the same way in recursive doubling (allgather too, where the
  paper has a different scheme), Rabenseifner and recursive halving. Where
  the folded virtual ranks then carry windows of uneven size, the formula is
  a max-plus recurrence over the q virtual ranks instead of a closed form.

Two network models (:func:`plait.sim.flat`):

* ``ports=False``, contention-free, the paper's: a message costs α + nβ however
  many others are in flight. Every formula in :data:`COVERED` holds for every p.
* ``ports=True``, the default: each rank's messages share its send and its
  receive port. :data:`ON_PORTS` lists what holds there: the ring algorithms
  for every p; powers of two for everything whose ranks never have two
  messages in (or out) at once; and port-aware versions of the algorithms
  that send to several peers at once (binomial broadcast, pairwise).
  Folding (p not a power of two) puts two messages into one port at once
  (the fold's and an early partner's), which these formulas do not model.

Every formula is checked against the simulator to 1e-9 relative in
``tests/sim/test_formulas.py``, for p = 1..33 and four regimes of α, β, γ, δ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from plait.algos.topology import pof2_floor

__all__ = ["COVERED", "ON_PORTS", "predict"]

Formula = Callable[[int, float, float, float, float, float], float]


def _lg(q: int) -> int:
    return q.bit_length() - 1


# -- allreduce ----------------------------------------------------------------------------


def allreduce_recursive_doubling(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``nδ + lg p·(α + nβ + nγ)``; otherwise ``nδ + (⌊lg p⌋+1)(α + nβ + nγ) + α + nβ``.

    Paper: ``lg p·α + n·lg p·β + n·lg p·γ``, and two more steps of n when it
    folds, as plait does. plait first copies IN to OUT (nδ; the folded-out rank
    too, since it sends OUT), and every exchange waits for its own message to
    land (the receive-and-reduce rewrites the region it sent), so a step ends
    when the later partner's message has arrived and the ranks stay in lock
    step. Folding adds one reducing step, unfolding one plain message.
    """
    q = pof2_floor(p)
    step = a + n * b + n * g
    if q == p:
        return n * d + _lg(p) * step
    return n * d + (_lg(q) + 1) * step + a + n * b


def allreduce_ring(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``nδ + 2(p-1)α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ``, any p.

    Paper (as usually quoted, e.g. Patarasuk and Yuan): the same without nδ,
    the copy of IN into OUT that every send waits for.
    """
    m = n / p
    return n * d + (p - 1) * (2 * a + 2 * m * b + m * g)


def allreduce_rabenseifner(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Power of two: ``nδ + 2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ``.

    Otherwise, with q = pof2_floor(p):
    ``max(nδ, α + nβ) + nγ + 2 lg q·α + 2((q-1)/q)·nβ + ((q-1)/q)·nγ + α + nβ``.
    Paper: ``(2⌊lg p⌋+2)α + (2(q-1)/q + 2)·nβ + (1 + (q-1)/q)·nγ`` (its p is our
    q in the fractions). plait's folded-out rank sends its input at once,
    while its neighbour copies its own into OUT, so the copy hides behind the
    fold message (the max). Ranks that did not fold start earlier, but every
    path through the halving and doubling from a folded rank back to one takes
    each step's full cost, so the late start carries through.
    """
    q = pof2_floor(p)
    lg = _lg(q)
    core = 2 * lg * a + 2 * (q - 1) / q * n * b + (q - 1) / q * n * g
    if q == p:
        return n * d + core
    return max(n * d, a + n * b) + n * g + core + a + n * b


def allreduce_swing(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Swing (De Sensi et al. 2024, after the paper): on the flat network, Rabenseifner's cost.

    Power of two: ``nδ + 2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ``: the same
    volumes per step, only the peers differ (which matters on tori, not here).
    Otherwise it folds like recursive doubling, whose extra rank copies IN to
    OUT before sending OUT, so the fold is ``nδ + α + nβ + nγ`` (no overlap)
    and the unfold ``α + nβ``.
    """
    q = pof2_floor(p)
    lg = _lg(q)
    core = 2 * lg * a + 2 * (q - 1) / q * n * b + (q - 1) / q * n * g
    if q == p:
        return n * d + core
    return n * d + a + n * b + n * g + core + a + n * b


def allreduce_binomial(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Binomial reduce to rank 0, then binomial broadcast from it (see both)."""
    return reduce_binomial(p, n, a, b, g, d) + broadcast_binomial(p, n, a, b, g, d)


def allreduce_direct_ports(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """With ports: ``2α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ``, any p; one rank: ``nδ``.

    Not in the paper. Each owner gets its slice from every rank at once, reduces
    the p-1 contributions straight from its input (no copy) and sends the result
    to all at once: the p-1 slices of each phase share the sender's port and the
    owner's receive port, so every byte a rank sends or receives counts, and
    the latency is paid once per phase. Only with ports: on the contention-free
    model p-1 concurrent messages would cost one. ``auto``'s profile ranking
    (:mod:`plait.selection.model`) leaves it out: α here is a latency paid once
    for p-1 concurrent messages, while a transport spends its per-message
    overhead on each of them, so on many ranks direct would look best for small
    vectors, where it is not.
    """
    if p == 1:
        return n * d
    m = n / p
    return 2 * a + 2 * (p - 1) * m * b + (p - 1) * m * g


# -- reduce_scatter and allgather ------------------------------------------------------------


def reduce_scatter_ring(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``nδ + (p-1)(α + (n/p)β + (n/p)γ) + (n/p)δ``, any p (n = the whole input).

    Paper: ``(p-1)α + ((p-1)/p)·n(β + γ)``. plait reduces in scratch: it copies
    the input there first and its own block out at the end.
    """
    m = n / p
    return n * d + (p - 1) * (a + m * b + m * g) + m * d


def allgather_ring(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``(n/p)δ + (p-1)(α + (n/p)β)``, any p (n = the whole output); the paper's plus one copy."""
    m = n / p
    return m * d + (p - 1) * (a + m * b)


def allgather_recursive_doubling(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Power of two: ``(n/p)δ + lg p·α + ((p-1)/p)·nβ``, the paper's plus one copy.

    Otherwise plait folds (the paper instead gives a separate scheme with
    messages of uneven sizes): each folded-out rank sends its block to its odd
    neighbour, which speaks for both, so virtual rank v's block is 2 real
    blocks for v < p - q and 1 otherwise, and the hypercube exchanges carry
    uneven windows. The time is then the longest chain of messages (each
    exchange waits only for the receives that filled what it sends), written
    as a max-plus recurrence over the q virtual ranks, plus the unfold: the
    whole output (n) back to each folded-out rank.
    """
    m = n / p
    q = pof2_floor(p)
    rem = p - q
    if q == p:
        return m * d + _lg(p) * a + (p - 1) * m * b
    w = [2 * m if v < rem else m for v in range(q)]  # bytes each virtual rank speaks for
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)

    def window(v: int, width: int) -> float:  # bytes of the aligned window holding v
        lo = v & ~(width - 1)
        return pre[lo + width] - pre[lo]

    # ready[v]: when v may send its next window (everything it sends has arrived).
    ready = [m * d + a + m * b if v < rem else m * d for v in range(q)]
    width = 1
    while width < q:
        ready = [
            max(ready[v], ready[v ^ width] + a + window(v ^ width, width) * b) for v in range(q)
        ]
        width <<= 1
    return max(max(ready), max(ready[:rem]) + a + n * b)


def allgather_bruck(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``⌈lg p⌉α + ((p-1)/p)·nβ`` for the messages when p is a power of two (the paper's).

    Step j (distance 2^j) sends the first ``c_j = min(2^j, p - 2^j)`` blocks of
    the rotated scratch buffer, which need only the receives of the steps
    that filled them (position i arrives at step ⌊lg i⌋). So when p is not a
    power of two the last, short step does not wait for the one before it:
    fewer than ⌈lg p⌉ message times may be on the longest chain (p = 3 takes
    one). plait also copies its block into OUT and into scratch, and every
    received run on into OUT, one copy at a time on the rank, while messages
    go on; the last run lands in OUT directly unless it wraps past rank p-1
    on some rank. The time is the later of the message chain and the copies.
    """
    m = n / p
    steps = []
    dist = 1
    while dist < p:
        steps.append((dist, min(dist, p - dist)))
        dist <<= 1
    if not steps:
        return m * d
    scratch = m * d * (2 if len(steps) > 1 else 1)  # copies into OUT, then into scratch
    arrive: list[float] = []
    copies: list[tuple[float, int, float]] = []  # copy-outs: (ready, step, bytes)
    for j, (dist, c) in enumerate(steps):
        if j == 0:
            send = 0.0  # the first message is IN itself
        else:
            needs = (c - 1).bit_length()  # positions [1, c) came in steps < needs
            send = max([scratch, *arrive[:needs]])
        arrive.append(send + a + c * m * b)
        last = j == len(steps) - 1
        if not last or p - dist >= 2:  # the last run wraps on some rank: copied out
            copies.append((arrive[-1], j, c * m))
    t = scratch
    for ready, _, size in sorted(copies):
        t = max(t, ready) + size * d
    return max(t, *arrive)


def reduce_scatter_recursive_halving(
    p: int, n: float, a: float, b: float, g: float, d: float
) -> float:
    """Power of two: ``nδ + lg p·α + ((p-1)/p)·n(β + γ) + (n/p)δ`` (n = the whole input).

    Paper: ``lg p·α + ((p-1)/p)·n(β + γ)``; plait reduces in scratch (copy in,
    copy own block out). Otherwise the folded-out ranks send their whole input
    (n) to their odd neighbour, which reduces it in (``max(nδ, α + nβ) + nγ``,
    the copy hidden behind the message), the halving runs over q virtual
    ranks of which v < p - q own two blocks (uneven windows: a max-plus
    recurrence over the chains of receive-and-reduce steps, where a rank that
    already has its partner's data only pays the reduction), and each folded
    rank sends its neighbour's block back (α + (n/p)β) while copying its own.
    """
    m = n / p
    q = pof2_floor(p)
    rem = p - q
    w = [2 * m if v < rem else m for v in range(q)]
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)
    t = [max(n * d, a + n * b) + n * g if v < rem else n * d for v in range(q)]
    half = q >> 1
    while half:
        nxt = []
        for v in range(q):
            lo = v & ~(half - 1)  # v keeps the aligned window of `half` blocks holding it
            kept = pre[lo + half] - pre[lo]
            nxt.append(max(t[v], t[v ^ half] + a + kept * b) + kept * g)
        t = nxt
        half >>= 1
    if not rem:
        return max(t) + m * d
    return max(max(t) + m * d, max(t[:rem]) + max(a + m * b, m * d))


def reduce_rabenseifner(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Rabenseifner's reduce to rank 0: the paper's cost plus nδ when p is a power of two.

    ``nδ + 2 lg p·α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ`` (copy of IN into the
    working buffer, recursive halving, binomial gather of the blocks along the
    same hypercube). Otherwise: the fold as in allreduce, the halving over q
    virtual ranks, and the gather, written as the longest chain over them (the
    gather waits at each virtual rank for all the windows it collects). Rank 0
    is folded out when p is not a power of two, so its neighbour gathers in
    its place and forwards the whole result (α + nβ).
    """
    q = pof2_floor(p)
    rem = p - q
    mq = n / q
    t = [max(n * d, a + n * b) + n * g if v < rem else n * d for v in range(q)]
    half = q >> 1
    while half:
        t = [max(t[v], t[v ^ half] + a + half * mq * b) + half * mq * g for v in range(q)]
        half >>= 1
    # Gather to virtual rank 0: at distance `width` the ranks with that bit set send.
    width = 1
    while width < q:
        t = [
            max(t[v], t[v ^ width] + a + width * mq * b) if not v & width else t[v]
            for v in range(q)
        ]
        width <<= 1
    return t[0] + (a + n * b if rem else 0.0)


def reduce_binomial(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """Binomial reduce: power of two, ``max(nδ, α + nβ) + nγ + (lg p - 1)(α + nβ + nγ)``.

    Paper: ``⌈lg p⌉(α + nβ + nγ)``. An inner node copies its input into its
    working buffer (nδ) while its first child's message is on the way, then
    reduces its children in order, each when its message is there. For other
    p, a subtree of s ranks (children at distances 1, 2, 4, … with subtrees of
    min(d, s-d) ranks) is ready to send at ``R(s)``: its copy, then each
    child's message ``max(previous, R(child) + α + nβ) + nγ``; leaves send at
    once. p = 1 is the copy alone.
    """
    return _binomial_ready(p, n, a, b, g, d) if p > 1 else n * d


@functools.lru_cache(maxsize=1024)
def _binomial_ready(s: int, n: float, a: float, b: float, g: float, d: float) -> float:
    if s == 1:
        return 0.0
    t = n * d
    dist = 1
    while dist < s:
        child = min(dist, s - dist)
        t = max(t, _binomial_ready(child, n, a, b, g, d) + a + n * b) + n * g
        dist <<= 1
    return t


def broadcast_binomial(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``depth·(α + nβ)``: ``lg p·(α + nβ)`` for a power of two, the paper's.

    The paper's root sends its ⌈lg p⌉ messages one after the other, so its
    last child waits ⌈lg p⌉ message times. plait's ranks send to all their
    children at once, so the time is the depth of the tree: the most set bits
    of a vrank below p, ``max(popcount(p-1), bit_length(p-1) - 1)``, which is
    ⌈lg p⌉ - 1 for some p that are not powers of two (p = 3, 5, 6, 9, …).
    """
    return _binomial_depth(p) * (a + n * b)


def _binomial_depth(p: int) -> int:
    """Edges from the root to the deepest vrank of a binomial tree over p ranks."""
    x = p - 1
    return max(x.bit_count(), x.bit_length() - 1) if x else 0


def broadcast_scatter_allgather(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``(lg p + p - 1)α + 2((p-1)/p)·nβ`` for a power of two (the paper's); any p below.

    A binomial scatter of p chunks of n/p, every subtree's chunks in one
    message, then a ring allgather. plait starts each rank's ring as soon as
    its own chunk is there, and a chunk then moves one rank per step, so the
    time is the latest chunk's arrival plus p - 1 ring steps. The latest
    arrival is the longest root-to-leaf path, a hop into a subtree of s ranks
    costing ``α + s(n/p)β``; for p = 2^k that is ``lg p·α + ((p-1)/p)·nβ``.
    """
    m = n / p
    return _scatter_depth(p, a, m * b) + (p - 1) * (a + m * b)


@functools.lru_cache(maxsize=1024)
def _scatter_depth(s: int, a: float, mb: float) -> float:
    """Latest arrival in a binomial scatter over a subtree of s ranks (chunk time ``mb``)."""
    best = 0.0
    dist = 1
    while dist < s:
        child = min(dist, s - dist)
        best = max(best, a + child * mb + _scatter_depth(child, a, mb))
        dist <<= 1
    return best


def reduce_scatter_pairwise(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``max((n/p)δ, α + (n/p)β) + ((p-1)/p)·nγ`` (n = the whole input).

    Paper: ``(p-1)α + ((p-1)/p)·n(β + γ)``: there each step is a blocking
    exchange. plait posts all p-1 sends at once (no message depends on
    another), so on the contention-free network all arrive after one message
    time; the reductions into the result then run one after the other.
    """
    m = n / p
    if p == 1:
        return m * d
    return max(m * d, a + m * b) + (p - 1) * m * g


def alltoall_pairwise(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """``max((n/p)δ, α + (n/p)β)`` (n = each rank's whole input); paper ``(p-1)α + nβ``.

    As for reduce_scatter: every message is posted at once and none waits for
    another; the copy of the rank's own block overlaps them.
    """
    m = n / p
    return max(m * d, a + m * b) if p > 1 else m * d


# -- the same on the flat network with ports: concurrent messages of a rank share its port ----


def broadcast_binomial_ports(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """With ports: a rank's k children share its send port, so all get the data after knβ.

    A subtree of s ranks takes ``α + ⌈lg s⌉·nβ`` plus its slowest child's
    subtree; for p = 2^k that is ``k·α + k(k+1)/2·nβ`` (the paper's
    ``k(α + nβ)`` sends the same messages one after another).
    """
    return _bcast_ports(p, n * b, a)


@functools.lru_cache(maxsize=1024)
def _bcast_ports(s: int, nb: float, a: float) -> float:
    if s == 1:
        return 0.0
    children = []
    dist = 1
    while dist < s:
        children.append(min(dist, s - dist))
        dist <<= 1
    return a + len(children) * nb + max(_bcast_ports(c, nb, a) for c in children)


def allreduce_binomial_ports(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """With ports: the reduce (no two messages meet for p = 2^k), then the broadcast."""
    return reduce_binomial(p, n, a, b, g, d) + broadcast_binomial_ports(p, n, a, b, g, d)


def reduce_scatter_pairwise_ports(
    p: int, n: float, a: float, b: float, g: float, d: float
) -> float:
    """With ports: all p-1 messages share each rank's ports: ``α + ((p-1)/p)·nβ``, then reduces."""
    m = n / p
    if p == 1:
        return m * d
    return max(m * d, a + (p - 1) * m * b) + (p - 1) * m * g


def alltoall_pairwise_ports(p: int, n: float, a: float, b: float, g: float, d: float) -> float:
    """With ports: ``max((n/p)δ, α + ((p-1)/p)·nβ)``: one latency, every byte through the port."""
    m = n / p
    return max(m * d, a + (p - 1) * m * b) if p > 1 else m * d


COVERED: dict[tuple[str, str], Formula] = {}


def predict(
    collective: str,
    algorithm: str,
    p: int,
    nbytes: float,
    alpha: float,
    beta: float,
    gamma: float,
    delta: float | None = None,
    *,
    ports: bool = False,
) -> float:
    """The formula's time for ``collective``/``algorithm`` on ``p`` ranks and ``nbytes``.

    ``ports=False`` is :func:`plait.sim.flat` with ``ports=False`` (contention-free,
    every formula, any p); ``ports=True`` the flat network with ports, where
    :data:`ON_PORTS` says which formulas hold and for which p. ``delta`` (copy
    cost) defaults to ``gamma``, as on :func:`plait.sim.flat`.

    Raises:
        KeyError: no formula for that algorithm, model and p.
    """
    d = gamma if delta is None else delta
    key = (collective, algorithm)
    if not ports:
        if key not in COVERED:
            raise KeyError(
                f"no formula for {collective}/{algorithm}; covered: "
                + ", ".join(f"{c}/{a}" for c, a in COVERED)
            )
        return COVERED[key](p, float(nbytes), alpha, beta, gamma, d)
    entry = ON_PORTS.get(key)
    if entry is None or (entry[1] == "pow2" and p & (p - 1)):
        raise KeyError(f"no formula for {collective}/{algorithm} with ports at p = {p}")
    return entry[0](p, float(nbytes), alpha, beta, gamma, d)


COVERED.update(
    {
        ("allreduce", "recursive_doubling"): allreduce_recursive_doubling,
        ("allreduce", "ring"): allreduce_ring,
        ("allreduce", "rabenseifner"): allreduce_rabenseifner,
        ("reduce_scatter", "ring"): reduce_scatter_ring,
        ("allgather", "ring"): allgather_ring,
        ("allgather", "recursive_doubling"): allgather_recursive_doubling,
        ("allgather", "bruck"): allgather_bruck,
        ("reduce_scatter", "recursive_halving"): reduce_scatter_recursive_halving,
        ("reduce_scatter", "pairwise"): reduce_scatter_pairwise,
        ("alltoall", "pairwise"): alltoall_pairwise,
        ("reduce", "binomial"): reduce_binomial,
        ("reduce", "rabenseifner"): reduce_rabenseifner,
        ("broadcast", "binomial"): broadcast_binomial,
        ("broadcast", "scatter_allgather"): broadcast_scatter_allgather,
        ("allreduce", "binomial"): allreduce_binomial,
        ("allreduce", "swing"): allreduce_swing,
    }
)

#: On the flat network with ports: (formula, "any" p or only "pow2"). Left out: the
#: scatter+allgather broadcast, whose scatter messages of different sizes share the
#: root's port while the ring starts under them.
ON_PORTS: dict[tuple[str, str], tuple[Formula, str]] = {
    ("allreduce", "ring"): (allreduce_ring, "any"),
    ("reduce_scatter", "ring"): (reduce_scatter_ring, "any"),
    ("allgather", "ring"): (allgather_ring, "any"),
    ("broadcast", "binomial"): (broadcast_binomial_ports, "any"),
    ("reduce_scatter", "pairwise"): (reduce_scatter_pairwise_ports, "any"),
    ("alltoall", "pairwise"): (alltoall_pairwise_ports, "any"),
    ("allreduce", "binomial"): (allreduce_binomial_ports, "pow2"),
    ("allreduce", "direct"): (allreduce_direct_ports, "any"),
    # Power of two: no rank ever has two messages in or out at once, so ports change nothing.
    **{
        key: (COVERED[key], "pow2")
        for key in [
            ("allreduce", "recursive_doubling"),
            ("allreduce", "rabenseifner"),
            ("allreduce", "swing"),
            ("reduce_scatter", "recursive_halving"),
            ("allgather", "recursive_doubling"),
            ("allgather", "bruck"),
            ("reduce", "binomial"),
            ("reduce", "rabenseifner"),
        ]
    },
}
