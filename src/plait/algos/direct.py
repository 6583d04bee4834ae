"""Direct allreduce: every rank owns a 1/p slice, gets it from everyone, reduces it, sends it back.

Phase 1 (reduce-scatter): rank r sends slice j of its vector straight to rank
j, for every j ≠ r, and reduces the p contributions to its own slice. Phase 2
(allgather): it sends its reduced slice straight to every other rank. No
message of a phase depends on another, so each phase is one step of p-1
concurrent messages: few steps but many messages, which suits shared memory
and full-bisection fabrics more than latency-bound networks. Messages go out
in pairwise order (to r+1, r+2, …) so that at any moment each rank is mostly
one sender's target; phase 1 is :func:`plait.algos.pairwise.reduce_to_owners`.

Cost (n bytes, p ranks):
    allreduce  2α + 2((p-1)/p)·nβ + ((p-1)/p)·nγ,  with p-1 messages per step
Restrictions: none. Any p, any count (slices may be empty). Non-commutative
ops are reduced in rank order x0 ∘ x1 ∘ … ∘ x(p-1); each slice has a single
owner that computes it once and sends it to all, so every rank holds
bit-identical values. In-place (``OUT`` aliasing ``IN``) is safe: the owner
reduces its slice in ``OUT`` where only it reads its own input slice, and a
rank receives slice j into ``OUT`` only after owner j has received that
rank's input slice j.

Example, p=3, vectors [a|b|c] on each rank cut into slices 0, 1, 2::

              phase 1 (reduce-scatter)        phase 2 (allgather)
    r0  sends b0→r1, c0→r2; OUT[a] = a0∘a1∘a2   sends OUT[a] → r1, r2
    r1  sends a1→r0, c1→r2; OUT[b] = b0∘b1∘b2   sends OUT[b] → r0, r2
    r2  sends a2→r0, b2→r1; OUT[c] = c0∘c1∘c2   sends OUT[c] → r0, r1
"""

from __future__ import annotations

from plait.algos._cost import Cost
from plait.algos._registry import register
from plait.algos.pairwise import pairwise_peers, reduce_to_owners
from plait.schedule.builder import Builder, blocks, segments

__all__: list[str] = []


# -- closed-form cost (plait.algos._cost) ----------------------------------------------


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


@register("allreduce", "direct", cost=Cost(ports=allreduce_direct_ports))
def allreduce(b: Builder) -> None:
    """Send each slice to its owner, which reduces it and sends it to all: 2 steps.

    The owner reduces in a fixed order (rank order for a non-commutative op), so every
    rank gets the same bits.

    Segments (``ctx.segment``) let an owner forward each piece of its slice as
    soon as that piece is reduced.
    """
    ctx = b.ctx
    p, r, seg = ctx.size, ctx.rank, ctx.segment
    parts = blocks(ctx.count, p)
    contributions = [b.inp.sub(o, n) for o, n in parts]
    slices = [b.out.sub(o, n) for o, n in parts]
    reduce_to_owners(b, contributions, slices[r], seg)
    mine = segments(slices[r], seg)
    for s in range(1, p):
        to, _ = pairwise_peers(r, p, s)
        for piece in mine:
            b.send(to, piece)
    for s in range(1, p):
        _, frm = pairwise_peers(r, p, s)
        for piece in segments(slices[frm], seg):
            b.recv(frm, piece)
