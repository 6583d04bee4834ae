"""``algorithm="auto"``: pick an algorithm from values every rank knows.

In order: the user's PLAIT_ALGO entries (:mod:`plait.selection.overrides`);
on one host with a measured profile (``plait tune``), the algorithm whose
closed-form α-β-γ time is lowest (:mod:`plait.selection.model`); otherwise a
rules table per collective, after MPICH's and Open MPI's defaults (Thakur et
al. 2005): latency-optimal algorithms for small messages, bandwidth-optimal
ones for large, and the world size where it matters. The inputs (collective,
world size, message bytes, op commutativity, the environment and the profile)
are identical on all ranks, so every rank chooses the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.algos._registry import AlgorithmSpec, algorithms, get
from plait.schedule.builder import HostLayout
from plait.selection import model
from plait.selection.overrides import overrides

__all__ = ["RULES", "SEGMENT_BYTES", "Rule", "select"]

#: Pipelining unit for segmented algorithms (ring, trees).
SEGMENT_BYTES = 1 << 20

_INF = float("inf")


@dataclass(frozen=True)
class Rule:
    """Use the first of ``algorithms`` the call allows when ranks and bytes are in range.

    ``nbytes`` is the whole vector for allreduce/reduce/broadcast and one
    rank's block for the block collectives (reduce_scatter, allgather,
    alltoall, gather, scatter). Ranges are half-open: ``min <= x < max``.
    """

    algorithms: tuple[str, ...]
    max_bytes: float = _INF
    min_ranks: int = 1
    max_ranks: float = _INF
    multi_host: bool | None = None  # True/False: only when ranks do/don't span hosts
    pof2: bool | None = None  # True: only when the number of ranks is a power of two

    def applies(self, size: int, nbytes: int, multi_host: bool) -> bool:
        """Whether the call is in this rule's range."""
        return (
            nbytes < self.max_bytes
            and self.min_ranks <= size < self.max_ranks
            and (self.multi_host is None or self.multi_host == multi_host)
            and (self.pof2 is None or self.pof2 == (size & (size - 1) == 0))
        )


RULES: dict[str, tuple[Rule, ...]] = {
    "allreduce": (
        # Measured with plait bench on 2 and 4 ranks (shared memory and TCP, 8 B .. 256 MiB):
        # recursive doubling's lg p rounds win up to 512 KiB, where ring's 2(p-1) rounds of
        # per-message cost still dominate; see docs/performance.md.
        # (With at most 8 ranks: recursive doubling sends lg p whole vectors, ring 2 in all.)
        Rule(("recursive_doubling",), max_bytes=512 << 10, max_ranks=9, multi_host=False),
        Rule(("recursive_doubling",), max_bytes=16 << 10),
        # Across hosts (inter-host links slower than intra-host ones): keep one
        # slice per rank on the network; pipeline the stages for large vectors.
        Rule(("hierarchical", "recursive_doubling"), max_bytes=4 << 20, multi_host=True),
        Rule(("cascade", "direct"), multi_host=True),
        Rule(("rabenseifner", "recursive_doubling"), max_bytes=1 << 20, min_ranks=16),
        # Large vectors on a power of two: Rabenseifner moves as few bytes as ring in lg p
        # rounds instead of 2(p - 1) (1.0-1.4x faster than ring at 2-128 MiB on 2 and 4 ranks).
        Rule(("rabenseifner", "ring", "direct"), pof2=True, multi_host=False),
        Rule(("ring", "direct")),
    ),
    "reduce": (
        Rule(("binomial",), max_bytes=64 << 10),
        Rule(("rabenseifner", "binomial")),
    ),
    "broadcast": (
        Rule(("binomial",), max_ranks=8),
        Rule(("binomial",), max_bytes=12 << 10),
        Rule(("scatter_allgather",)),
    ),
    "reduce_scatter": (
        Rule(("recursive_halving", "pairwise"), max_bytes=64 << 10),
        Rule(("ring", "pairwise")),
    ),
    "allgather": (
        Rule(("bruck",), max_bytes=8 << 10),
        Rule(("ring",)),
    ),
    "alltoall": (
        Rule(("bruck",), max_bytes=256, min_ranks=8),
        Rule(("pairwise",)),
    ),
    "gather": (Rule(("binomial",)),),
    "scatter": (Rule(("binomial",)),),
    "barrier": (Rule(("dissemination",)),),
}


def select(
    collective: str,
    size: int,
    nbytes: int,
    *,
    commutative: bool,
    hosts: HostLayout | None = None,
) -> AlgorithmSpec:
    """The algorithm ``auto`` runs for this call (``hosts``: None when all share one host).

    PLAIT_ALGO entries (:mod:`plait.selection.overrides`) come first; then, on
    one host with a measured profile (``plait tune``), the algorithm the cost
    model (:mod:`plait.selection.model`) predicts fastest; then the rules.
    """
    for entry in overrides():
        if entry.collective == collective and entry.covers(nbytes):
            spec = get(collective, entry.algorithm)
            if spec.supports(commutative=commutative):
                return spec
    multi_host = hosts is not None and hosts.n_hosts > 1
    if not multi_host and size > 1:
        profile = model.load()
        if profile is not None:
            names = [
                n
                for n in algorithms(collective)
                if get(collective, n).supports(commutative=commutative)
            ]
            best = model.predict_best(collective, size, nbytes, names, profile)
            if best is not None:
                return get(collective, best[0])
    rules = RULES[collective]
    for rule in rules:
        if rule.applies(size, nbytes, multi_host):
            for name in rule.algorithms:
                spec = get(collective, name)
                if spec.supports(commutative=commutative):
                    return spec
    for rule in rules:  # nothing in range fits the op: any algorithm that does
        for name in rule.algorithms:
            spec = get(collective, name)
            if spec.supports(commutative=commutative):
                return spec
    raise LookupError(f"no {collective} algorithm supports this call")  # pragma: no cover
