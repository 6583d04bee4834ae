"""``algorithm="auto"``: pick an algorithm from values every rank knows.

For now a rules table per collective, after MPICH's and Open MPI's defaults
(Thakur et al. 2005): latency-optimal algorithms for small messages,
bandwidth-optimal ones for large, and the world size where it matters. The
inputs (collective, world size, message bytes, op commutativity) are identical
on all ranks, so every rank chooses the same schedule. A measured cost model
replaces the table later; the table stays as the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.algos._registry import AlgorithmSpec, get

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


RULES: dict[str, tuple[Rule, ...]] = {
    "allreduce": (
        Rule(("recursive_doubling",), max_bytes=16 << 10),
        Rule(("rabenseifner", "recursive_doubling"), max_bytes=1 << 20, min_ranks=16),
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


def select(collective: str, size: int, nbytes: int, *, commutative: bool) -> AlgorithmSpec:
    """The algorithm ``auto`` runs for this call."""
    rules = RULES[collective]
    for rule in rules:
        if nbytes < rule.max_bytes and rule.min_ranks <= size < rule.max_ranks:
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
