"""``algorithm="auto"``: pick an algorithm from values every rank knows.

For now a rules table per collective: latency-optimal algorithms below a size
threshold, bandwidth-optimal ones above (thresholds after MPICH's and Open
MPI's defaults, Thakur et al. 2005). Every input to the choice (collective,
world size, message bytes, op commutativity) is identical on all ranks, so all
ranks choose the same schedule. A later cost model replaces the table.
"""

from __future__ import annotations

from plait.algos._registry import AlgorithmSpec, get

__all__ = ["RULES", "SEGMENT_BYTES", "select"]

#: Pipelining unit for segmented algorithms (ring, trees).
SEGMENT_BYTES = 1 << 20

# Per collective: (upper bound on message bytes, preferred algorithms in order).
# The first rule whose bound exceeds the message size applies; within it, the
# first algorithm whose restrictions the call meets wins. "Message bytes" is
# the whole vector for allreduce/reduce/broadcast and one rank's block for
# the block collectives.
RULES: dict[str, tuple[tuple[float, tuple[str, ...]], ...]] = {
    "allreduce": (
        (16 << 10, ("recursive_doubling",)),
        (float("inf"), ("ring", "direct")),
    ),
    "reduce": (
        (64 << 10, ("binomial",)),
        (float("inf"), ("rabenseifner", "binomial")),
    ),
    "broadcast": (
        (12 << 10, ("binomial",)),
        (float("inf"), ("scatter_allgather",)),
    ),
    "reduce_scatter": (
        (64 << 10, ("recursive_halving", "pairwise")),
        (float("inf"), ("ring", "pairwise")),
    ),
    "allgather": (
        (8 << 10, ("bruck",)),
        (float("inf"), ("ring",)),
    ),
    "alltoall": (
        (256, ("bruck",)),
        (float("inf"), ("pairwise",)),
    ),
    "gather": ((float("inf"), ("binomial",)),),
    "scatter": ((float("inf"), ("binomial",)),),
    "barrier": ((float("inf"), ("dissemination",)),),
}


def select(collective: str, size: int, nbytes: int, *, commutative: bool) -> AlgorithmSpec:
    """The algorithm ``auto`` runs for this call."""
    for bound, names in RULES[collective]:
        if nbytes < bound:
            for name in names:
                spec = get(collective, name)
                if spec.supports(commutative=commutative):
                    return spec
    for _bound, names in RULES[collective]:  # nothing in range fits: any that does
        for name in names:
            spec = get(collective, name)
            if spec.supports(commutative=commutative):
                return spec
    raise LookupError(f"no {collective} algorithm supports this call")  # pragma: no cover
