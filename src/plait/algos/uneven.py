"""The uneven collectives: allgatherv, gatherv, scatterv, alltoallv and reduce_scatterv.

Each is its even twin's algorithm with blocks of per-rank lengths
(``Context.counts``, see :class:`plait.collectives.Uneven`): block ``q`` is
``c[q]`` elements at displacement ``d[q] = c[0] + … + c[q-1]``, and alltoallv's
block from i to j is ``m[i][j]`` elements. Every rank's context carries all the
counts, so both ends of every message compute its length alike; a block of
zero elements is no message (the builder drops empty sends and receives on
both sides), except that a gatherv or allgatherv rank without rows sends a
one-element token where its rows would go, and a reduce_scatterv rank without
rows receives one from every rank, so that one that disagrees on the counts is
never unseen (Note [the root's word] in :mod:`plait.algos._rooted`),
and a call with no rows anywhere meets its peers (Note [empty calls meet] in
:mod:`plait.algos._presence`). With every count equal
to ``k`` each builder records exactly the schedule of its even twin with
``count = k`` (``tests/unit/test_symbolic_v.py`` checks it), which is why the
twins' closed-form costs are registered here too: they hold for equal counts.
For uneven counts no formula in the whole buffer ``n`` alone exists: a ring
step lasts as long as its largest block (Σ_s max_r c[r-s] over the steps), a
tree edge carries its subtree's sum, a direct root its whole input.

Algorithms (n = the whole buffer, p ranks; times for equal counts):

    allgatherv       ring      (p-1)α + ((p-1)/p)·nβ        as allgather ring
                     direct    α + ((p-1)/p)·nβ per port    every block straight to everyone
    gatherv          direct    α + ((p-1)/p)·nβ into root   each rank sends its block to root
                     binomial  ⌈lg p⌉α + ((p-1)/p)·nβ       as gather binomial
    scatterv         direct    α + ((p-1)/p)·nβ out of root root sends every block
                     binomial  ⌈lg p⌉α + ((p-1)/p)·nβ       as scatter binomial
    alltoallv        pairwise  α + ((p-1)/p)·nβ per port    as alltoall pairwise
    reduce_scatterv  ring      (p-1)α + ((p-1)/p)·n(β + γ)  as reduce_scatter ring
                     pairwise  α + ((p-1)/p)·n(β + γ)       as reduce_scatter pairwise

Restrictions: reduce_scatterv ring needs a commutative op (chunk j is reduced
starting at rank j+1); pairwise reduces in rank order. alltoallv and
reduce_scatterv pairwise are not in-place (they write ``OUT`` while input
blocks are still to go out). alltoallv has no "direct" twin: pairwise already
posts every message at once with no dependencies, so a direct schedule would
be the same messages in a worse order (every rank's first send to rank 0).

Example, allgatherv ring, p=3, counts (2, 0, 1), OUT = [a a | | c]::

    step 0: r0 sends a→r1, r1 sends a token (its block is empty), r2 sends c→r0
    step 1: r0 sends c→r1, r1 sends a→r2, r2 receives the token from r1 (a block of
            its own, one element in scratch: it goes no further)
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.algos._cost import Cost
from plait.algos._presence import moves_nothing
from plait.algos._registry import register
from plait.algos._rooted import agree_on_root, ends_with_the_roots_word
from plait.algos.binomial import subtree_size, wrap_runs
from plait.algos.pairwise import (
    alltoall_pairwise,
    alltoall_pairwise_ports,
    pairwise_peers,
    reduce_scatter_pairwise,
    reduce_scatter_pairwise_ports,
    reduce_to_owners,
)
from plait.algos.ring import (
    allgather_ring,
    reduce_scatter_ring,
    ring_allgather,
    ring_reduce_scatter,
)
from plait.algos.topology import binomial_children, binomial_parent
from plait.collectives import displacements
from plait.schedule.builder import Builder, segments
from plait.schedule.ir import Region

__all__ = ["uneven_blocks"]


def uneven_blocks(region: Region, counts: Sequence[int]) -> list[Region]:
    """``region`` cut into back-to-back blocks of ``counts`` elements (some may be empty)."""
    return [region.sub(d, c) for d, c in zip(displacements(counts), counts, strict=True)]


def _send_all(b: Builder, peer: int, region: Region) -> None:
    for seg in segments(region, b.ctx.segment):
        b.send(peer, seg)


def _recv_all(b: Builder, peer: int, region: Region) -> None:
    for seg in segments(region, b.ctx.segment):
        b.recv(peer, seg)


# -- allgatherv -----------------------------------------------------------------------------


@register("allgatherv", "ring", cost=Cost(allgather_ring, allgather_ring))
def allgatherv_ring(b: Builder) -> None:
    """Ring allgather of uneven blocks: p-1 steps, each moving one rank's block one hop."""
    ctx = b.ctx
    blocks = uneven_blocks(b.out, ctx.block_counts())
    b.copy(b.inp, blocks[ctx.rank])
    ring_allgather(b, range(ctx.size), ctx.rank, _tokens_for_empty(b, blocks), ctx.segment)


@register("allgatherv", "direct")
def allgatherv_direct(b: Builder) -> None:
    """Every rank sends its block straight to every other, in pairwise order: one step.

    No message waits for another, so latencies overlap; each rank's port
    carries its block p-1 times, which suits shared memory and full-bisection
    fabrics more than a ring does when blocks are small or very uneven.
    """
    ctx = b.ctx
    p, r = ctx.size, ctx.rank
    blocks = uneven_blocks(b.out, ctx.block_counts())
    b.copy(b.inp, blocks[r])
    sent = _tokens_for_empty(b, [*blocks[:r], b.inp, *blocks[r + 1 :]])
    for s in range(1, p):
        _send_all(b, pairwise_peers(r, p, s)[0], sent[r])
    for s in range(1, p):
        frm = pairwise_peers(r, p, s)[1]
        _recv_all(b, frm, sent[frm])


def _tokens_for_empty(b: Builder, blocks: list[Region]) -> list[Region]:
    """``blocks``, each empty one replaced by a one-element token in scratch where the call
    moves something: a rank without rows sends a token where its rows would go, checked like
    any message, so that a rank which disagrees on the counts is never unseen (Note [the
    root's word] in :mod:`plait.algos._rooted`)."""
    if moves_nothing(b):
        return blocks
    return [blk if blk.count else b.scratch(1) for blk in blocks]


# -- gatherv and scatterv -------------------------------------------------------------------


@register("gatherv", "direct")
@ends_with_the_roots_word
def gatherv_direct(b: Builder) -> None:
    """Every rank sends its block straight to the root, which receives them in place: one step."""
    ctx = b.ctx
    p, r, root = ctx.size, ctx.rank, ctx.root
    if r != root:  # a rank without rows sends a token (Note [the root's word])
        _send_all(b, root, _tokens_for_empty(b, [b.inp])[0])
        return
    blocks = uneven_blocks(b.out, ctx.block_counts())
    b.copy(b.inp, blocks[r])
    got = _tokens_for_empty(b, blocks)
    for s in range(1, p):
        q = (root + s) % p
        _recv_all(b, q, got[q])


@register("scatterv", "direct")
def scatterv_direct(b: Builder) -> None:
    """The root sends every rank its block straight from ``IN``: one step."""
    ctx = b.ctx
    p, r, root = ctx.size, ctx.rank, ctx.root
    agree_on_root(b)
    if r != root:
        _recv_all(b, root, b.out)
        return
    blocks = uneven_blocks(b.inp, ctx.block_counts())
    b.copy(blocks[r], b.out)
    for s in range(1, p):
        q = (root + s) % p
        _send_all(b, q, blocks[q])


def _vrank_offsets(counts: Sequence[int], root: int) -> list[int]:
    """Prefix sums of the counts in vrank order (vrank v is rank (v + root) % p), p + 1 long."""
    p = len(counts)
    out = [0]
    for v in range(p):
        out.append(out[-1] + counts[(v + root) % p])
    return out


@register("gatherv", "binomial")
@ends_with_the_roots_word
def gatherv_binomial(b: Builder) -> None:
    """Binomial-tree gather of uneven blocks: each rank forwards its subtree's, ⌈lg p⌉ steps.

    As gather binomial (:mod:`plait.algos.binomial`): a subtree is a range of
    vranks, so its blocks lie back to back in vrank order; the edge to the
    root moves one message per run of real ranks, landing in place in ``OUT``.
    """
    ctx = b.ctx
    p, r, root = ctx.size, ctx.rank, ctx.root
    counts = ctx.block_counts()
    at = _vrank_offsets(counts, root)
    v = (r - root) % p
    parent = binomial_parent(v)
    children = binomial_children(v, p)
    # A subtree without rows sends a token instead of nothing (Note [the root's word]).
    token = not moves_nothing(b)

    def empty(w: int) -> bool:
        return token and at[w + subtree_size(w, p)] == at[w]

    # The tokens' receives, which what this rank sends on follows.
    heard = [b.recv((c + root) % p, b.scratch(1)) for c in children if empty(c)]
    if parent < 0:
        real_at = displacements(counts)
        b.copy(b.inp, b.out.sub(real_at[r], counts[r]))
        for child in children:
            for lo, hi in wrap_runs(child, child + subtree_size(child, p), root, p):
                run = b.out.sub(real_at[(lo + root) % p], at[hi] - at[lo])
                _recv_all(b, (child + root) % p, run)
        return
    to = (parent + root) % p
    if empty(v):
        b.send(to, b.scratch(1), after=heard)
        return
    n = subtree_size(v, p)
    buf = b.inp
    if children:
        buf = b.scratch(at[v + n] - at[v])
        b.copy(b.inp, buf.sub(0, counts[r]))
        for child in children:
            end = child + subtree_size(child, p)
            _recv_all(b, (child + root) % p, buf.sub(at[child] - at[v], at[end] - at[child]))
    runs = wrap_runs(v, v + n, root, p) if parent == 0 else [(v, v + n)]
    for lo, hi in runs:
        for seg in segments(buf.sub(at[lo] - at[v], at[hi] - at[lo]), ctx.segment):
            b.send(to, seg, after=heard)


@register("scatterv", "binomial")
def scatterv_binomial(b: Builder) -> None:
    """Binomial-tree scatter of uneven blocks: each rank passes on its subtree's, ⌈lg p⌉ steps.

    The mirror of gatherv binomial: the root sends each child's subtree
    straight from ``IN`` (one message per run of real ranks), farthest first.
    """
    ctx = b.ctx
    p, r, root = ctx.size, ctx.rank, ctx.root
    agree_on_root(b)
    counts = ctx.block_counts()
    at = _vrank_offsets(counts, root)
    v = (r - root) % p
    parent = binomial_parent(v)
    children = binomial_children(v, p)[::-1]  # farthest subtree first
    if parent < 0:
        real_at = displacements(counts)
        b.copy(b.inp.sub(real_at[r], counts[r]), b.out)
        for child in children:
            for lo, hi in wrap_runs(child, child + subtree_size(child, p), root, p):
                run = b.inp.sub(real_at[(lo + root) % p], at[hi] - at[lo])
                _send_all(b, (child + root) % p, run)
        return
    n = subtree_size(v, p)
    buf = b.scratch(at[v + n] - at[v]) if children else b.out
    runs = wrap_runs(v, v + n, root, p) if parent == 0 else [(v, v + n)]
    for lo, hi in runs:
        _recv_all(b, (parent + root) % p, buf.sub(at[lo] - at[v], at[hi] - at[lo]))
    for child in children:
        end = child + subtree_size(child, p)
        _send_all(b, (child + root) % p, buf.sub(at[child] - at[v], at[end] - at[child]))
    if children:
        b.copy(buf.sub(0, counts[r]), b.out)


# -- alltoallv ------------------------------------------------------------------------------


@register(
    "alltoallv",
    "pairwise",
    in_place=False,
    cost=Cost(alltoall_pairwise, alltoall_pairwise_ports),
)
def alltoallv_pairwise(b: Builder) -> None:
    """Pairwise exchange of uneven blocks: step s sends to r+s and receives from r-s.

    Rank r's ``IN`` is its row of the matrix back to back (block j for rank j),
    its ``OUT`` its column (block i from rank i). ``ctx.segment`` is ignored:
    nothing is forwarded, so there is nothing to pipeline.
    """
    ctx = b.ctx
    p, r = ctx.size, ctx.rank
    m = ctx.block_counts()
    sends = uneven_blocks(b.inp, m[r * p : (r + 1) * p])
    recvs = uneven_blocks(b.out, m[r::p])
    b.copy(sends[r], recvs[r])
    for s in range(1, p):
        to, frm = pairwise_peers(r, p, s)
        b.send(to, sends[to])
        b.recv(frm, recvs[frm])


# -- reduce_scatterv ------------------------------------------------------------------------


@register(
    "reduce_scatterv",
    "ring",
    commutative_only=True,
    cost=Cost(reduce_scatter_ring, reduce_scatter_ring),
)
def reduce_scatterv_ring(b: Builder) -> None:
    """Ring reduce-scatter of uneven blocks in scratch, then each copies out its own: p-1 steps."""
    ctx = b.ctx
    counts = ctx.block_counts()
    work = b.scratch(sum(counts))
    b.copy(b.inp, work)
    chunks = uneven_blocks(work, counts)
    ring_reduce_scatter(b, range(ctx.size), ctx.rank, chunks, ctx.segment)
    b.copy(chunks[ctx.rank], b.out)
    _tokens_to_ranks_without_rows(b, counts)


@register(
    "reduce_scatterv",
    "pairwise",
    in_place=False,
    cost=Cost(reduce_scatter_pairwise, reduce_scatter_pairwise_ports),
)
def reduce_scatterv_pairwise(b: Builder) -> None:
    """Pairwise exchange of uneven blocks, each reduced by its owner, in rank order: p-1 steps."""
    ctx = b.ctx
    counts = ctx.block_counts()
    reduce_to_owners(b, uneven_blocks(b.inp, counts), b.out, ctx.segment)
    _tokens_to_ranks_without_rows(b, counts)


def _tokens_to_ranks_without_rows(b: Builder, counts: Sequence[int]) -> None:
    """A one-element token from every rank to each rank without rows, in pairwise order,
    where the call moves something: such a rank receives no data, and would otherwise end
    its call unseen by a peer that disagrees on the counts (Note [the root's word] in
    :mod:`plait.algos._rooted`). Ranks with rows hear from every rank through their data."""
    if moves_nothing(b):
        return
    p, r = b.size, b.rank
    for s in range(1, p):
        to, frm = pairwise_peers(r, p, s)
        if not counts[to]:
            b.send(to, b.scratch(1))
        if not counts[r]:
            b.recv(frm, b.scratch(1))
