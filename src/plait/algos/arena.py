"""One-sided collectives for ranks of one host: copy into a shared window, post, read the peers'.

Where every rank of a call runs on one host, each has a *window* that its peers
map (:mod:`plait.transport.shm.window`): a collective is then a few copies and
numpy reductions straight out of the peers' windows, with one counter store
(``POST``) and a few counter reads (``GET``/``WAIT``) per piece, instead of
messages through per-pair rings. The Python cost is per piece, not per 64 KiB
segment, and every byte is copied once into the window and once out of it.

Shapes, for p ranks and a vector of n elements cut into pieces that fit the
window (``ctx.window`` bytes; ``ctx.segment`` elements at most where set):

``allreduce/arena`` (two-shot)
    Each piece: copy in the slices the others own; post; reduce one's own slice
    straight from every window, in rank order, into one's window; post; copy the
    others' reduced slices out. Each element is reduced once, by its owner, so
    every rank gets the owner's bits; each rank reads (p-1)/p of the piece from
    each phase.
``allreduce/arena_oneshot``
    Each piece: copy in; post; reduce the whole piece from every window in rank
    order. One wait instead of two, p-1 times the reduction work: for small
    vectors, where the wait costs more than the work. Every rank folds the same
    operands in the same order, so the bits agree.
``reduce``: the two-shot's first half; the root copies the slices out.
``broadcast``, ``scatter``: the root copies in, the others copy out.
``gather``, ``allgather``, ``alltoall``, ``reduce_scatter``: everyone copies in,
then reads what it needs of each window. ``barrier``: post, wait for everyone.

Reuse of window regions within a call: a rank overwrites a region only after
every reader of its previous contents has posted a later phase (it has then
finished reading): :class:`_Sync` adds the ``WAIT`` steps where no ``GET``
already implies it, and :func:`plait.schedule.verify.run_joint` proves the
rule for every interleaving. Between calls the executor alternates the two
halves of the window (Note [window reuse] in :mod:`plait.transport.shm.window`).

Pieces that would be reused while still read alternate between two buffers,
so a rank fills piece k+1 while its peers read piece k.

Restrictions: one host (a window); any p, any count. Non-commutative ops are
reduced in rank order. Every schedule here is correct in place.
"""

from __future__ import annotations

from plait.algos._presence import post_and_wait_all
from plait.algos._registry import register
from plait.schedule.builder import Builder, blocks
from plait.schedule.ir import Region

__all__: list[str] = []


class _Sync:
    """The phase of each peer this rank has waited for: a WAIT is added only where needed."""

    __slots__ = ("_b", "_seen")

    def __init__(self, b: Builder) -> None:
        self._b = b
        self._seen = [0] * b.size

    def get(self, peer: int, src: Region, dst: Region, phase: int) -> None:
        """``dst = peer's src`` once it posted ``phase``."""
        if self._b.get(peer, src, dst, phase) >= 0:
            self._seen[peer] = max(self._seen[peer], phase)

    def get_reduce(self, peer: int, src: Region, dst: Region, phase: int) -> None:
        """``dst = dst ∘ peer's src`` once it posted ``phase``."""
        if self._b.get_reduce(peer, src, dst, phase, get_first=False) >= 0:
            self._seen[peer] = max(self._seen[peer], phase)

    def need(self, peer: int, phase: int) -> None:
        """Make sure ``peer`` has posted ``phase`` before what follows."""
        if phase >= 1 and self._seen[peer] < phase:
            self._b.wait(peer, phase)
            self._seen[peer] = phase

    def need_all(self, phase: int) -> None:
        """:meth:`need` for every other rank."""
        for q in range(self._b.size):
            if q != self._b.rank:
                self.need(q, phase)


def _window_elements(b: Builder) -> int:
    ctx = b.ctx
    if ctx.window <= 0:
        raise ValueError(
            f"rank {b.rank}: {ctx.collective}: the one-sided algorithms run only where the "
            "ranks share memory on one host (the shared-memory transport's window; "
            "PLAIT_SHM_WINDOW > 0); use algorithm='auto' or a message-passing one"
        )
    return ctx.window // ctx.itemsize


def _piece(b: Builder, count: int, per_element: float) -> int:
    """Elements per piece: at most ``ctx.segment``, and ``per_element`` window elements each.

    ``per_element`` is how many window elements one element of the piece takes
    (e.g. 2 for two alternating buffers). At least 1 where count > 0.
    """
    limit = int(_window_elements(b) / per_element)
    if limit < 1:
        raise ValueError(
            f"rank {b.rank}: a window of {b.ctx.window} bytes cannot hold one piece "
            f"of {b.ctx.itemsize}-byte elements"
        )
    seg = b.ctx.segment
    piece = min(count, limit, seg) if seg > 0 else min(count, limit)
    return max(piece, 1)


def _buffers(b: Builder, piece: int, pieces: int) -> list[Region]:
    """One window buffer of ``piece`` elements, or two to alternate between when pieces > 1."""
    return [b.shared(piece) for _ in range(2 if pieces > 1 else 1)]


def _fold(b: Builder, sync: _Sync, dst: Region, own: Region, theirs: Region, phase: int) -> None:
    """``dst = x0 ∘ x1 ∘ … ∘ x(p-1)`` in rank order: this rank's ``own``, the others' ``theirs``.

    ``own`` must not be ``dst``'s memory (unless it is this rank's turn first).
    """
    r = b.rank
    for q in range(b.size):
        if q == r:
            if q == 0:
                b.copy(own, dst)
            else:
                b.reduce(own, dst, src_first=False)
        elif q == 0:
            sync.get(q, theirs, dst, phase)
        else:
            sync.get_reduce(q, theirs, dst, phase)


def _alone(b: Builder) -> bool:
    """Whether the call needs no window: nothing to move, or one rank (it copies IN to OUT)."""
    if b.ctx.count == 0:
        return True
    if b.size == 1:
        b.copy(b.inp, b.out)
        return True
    return False


def _span(n: int, step: int) -> list[tuple[int, int]]:
    """(offset, length) of the pieces of ``n`` elements, ``step`` at a time."""
    return [(o, min(step, n - o)) for o in range(0, n, step)]


# -- allreduce, reduce ------------------------------------------------------------------------


def _two_shot(b: Builder, root: int | None) -> None:
    """Owners reduce slices from the windows; all ranks (or ``root``) copy the slices out."""
    if _alone(b):
        return
    p, r, n = b.size, b.rank, b.ctx.count
    # A piece takes its own length in the window plus its largest slice.
    piece = _piece(b, n, 1 + 1 / p)
    while piece > 1 and piece + -(-piece // p) > _window_elements(b):
        piece -= 1
    inbuf = b.shared(piece)
    outbuf = b.shared(-(-piece // p))
    sync = _Sync(b)
    spans = _span(n, piece)
    for k, (o, m) in enumerate(spans):
        parts = blocks(m, p)
        lo, ln = parts[r]
        # Peers read inbuf in their reduce of piece k-1, before posting 2k.
        sync.need_all(2 * k)
        b.copy(b.inp.sub(o, lo), inbuf.sub(0, lo))
        b.copy(b.inp.sub(o + lo + ln, m - lo - ln), inbuf.sub(lo + ln, m - lo - ln))
        b.post(2 * k + 1)
        if ln:
            # Readers of outbuf's piece k-1 post 2k+1 once they copied it out.
            sync.need_all(2 * k + 1)
            acc = outbuf.sub(0, ln)
            _fold(b, sync, acc, b.inp.sub(o + lo, ln), inbuf.sub(lo, ln), 2 * k + 1)
            if root is None or r == root:
                b.copy(acc, b.out.sub(o + lo, ln))
        b.post(2 * k + 2)
        if root is None or r == root:
            for q in range(p):
                qo, qn = parts[q]
                if q != r and qn:
                    sync.get(q, outbuf.sub(0, qn), b.out.sub(o + qo, qn), 2 * k + 2)
    # The last piece's readers: nothing follows in this call (the executor's halves cover
    # the next call), so no wait is needed here.
    if root is not None and any(not _slices(spans, p, q) for q in range(p)):
        # A rank that owns no slice (fewer elements than ranks) reads no window: it waits
        # for the root's word that it has read every slice (Note [the root's word] in
        # plait.algos._rooted), whose owners read every window.
        if r == root:
            b.post(2 * len(spans) + 1)
        elif not _slices(spans, p, r):
            sync.need(root, 2 * len(spans) + 1)


def _slices(spans: list[tuple[int, int]], p: int, q: int) -> bool:
    """Whether rank ``q`` owns a slice of some piece of ``spans``."""
    return any(blocks(m, p)[q][1] for _, m in spans)


@register("allreduce", "arena", needs_window=True)
def allreduce_two_shot(b: Builder) -> None:
    """Owners reduce their slice from every window, then all copy the slices out.

    Two phases per piece; each element reduced once. See the module docstring.
    """
    _two_shot(b, None)


@register("reduce", "arena", needs_window=True)
def reduce_two_shot(b: Builder) -> None:
    """Owners reduce their slice from every window; the root copies the slices out."""
    _two_shot(b, b.ctx.root)


@register("allreduce", "arena_oneshot", needs_window=True)
def allreduce_one_shot(b: Builder) -> None:
    """Every rank reduces the whole vector from every window, in rank order.

    One phase per piece, p-1 times the reduction work of ``arena``: for small vectors.
    """
    if _alone(b):
        return
    n = b.ctx.count
    spans = _span(n, _piece(b, n, 2))
    bufs = _buffers(b, spans[0][1], len(spans))
    sync = _Sync(b)
    for k, (o, m) in enumerate(spans):
        buf = bufs[k % 2].sub(0, m)
        sync.need_all(k)  # readers of this buffer's piece k-2 posted k (piece k-1) after it
        b.copy(b.inp.sub(o, m), buf)
        b.post(k + 1)
        # Own operand from the window copy: in place, OUT (= IN) is overwritten first.
        _fold(b, sync, b.out.sub(o, m), buf if b.rank else b.inp.sub(o, m), buf, k + 1)


@register("allreduce", "arena_leader", needs_window=True)
def allreduce_leader(b: Builder) -> None:
    """Rank 0 reduces the whole vector from every window, in rank order; the others copy it.

    Two phases per piece, each element reduced once and by one rank: the least work in
    all, for ranks that outnumber the cores, where the work of all ranks is the time.
    """
    if _alone(b):
        return
    n, r = b.ctx.count, b.rank
    spans = _span(n, _piece(b, n, 2))
    bufs = _buffers(b, spans[0][1], len(spans))
    sync = _Sync(b)
    for k, (o, m) in enumerate(spans):
        # No waits for reuse: rank 0 writes a buffer only after reading every rank's post of
        # the piece after the one they last read from it, and each rank writes its own only
        # after reading rank 0's result of the piece before, which rank 0 posts after
        # reading every rank's buffer.
        buf = bufs[k % 2].sub(0, m)
        if r == 0:
            _fold(b, sync, buf, b.inp.sub(o, m), buf, 2 * k + 1)
            b.copy(buf, b.out.sub(o, m))
            b.post(2 * k + 2)
        else:
            b.copy(b.inp.sub(o, m), buf)
            b.post(2 * k + 1)
            if k == 0:
                # Rank 0 posts only once every rank has: waiting for each first costs a look
                # at its counter, and a rank that never comes, or is in another call, is then
                # named by every rank, not by rank 0 alone.
                for q in range(1, b.size):
                    if q != r:
                        sync.need(q, 1)
            sync.get(0, buf, b.out.sub(o, m), 2 * k + 2)


# -- broadcast, scatter ----------------------------------------------------------------------


@register("broadcast", "arena", needs_window=True)
def broadcast_arena(b: Builder) -> None:
    """The root copies each piece into its window; the others copy it out."""
    ctx = b.ctx
    p, r, n, root = b.size, b.rank, ctx.count, ctx.root
    if n == 0 or p == 1:
        return
    spans = _span(n, _piece(b, n, 2))
    bufs = _buffers(b, spans[0][1], len(spans))
    sync = _Sync(b)
    reuse = len(spans) > 2  # only then does the root wait for its readers
    for k, (o, m) in enumerate(spans):
        buf = bufs[k % 2].sub(0, m)
        if r == root:
            sync.need_all(k - 1)  # readers of piece k-2 posted k-1 after reading it
            b.copy(b.out.sub(o, m), buf)
            b.post(k + 1)
        else:
            sync.get(root, buf, b.out.sub(o, m), k + 1)
            if reuse or k == 0:
                b.post(k + 1)
    sync.need_all(1)  # Note [rooted calls agree on the root] in plait.algos._rooted


@register("scatter", "arena", needs_window=True)
def scatter_arena(b: Builder) -> None:
    """The root copies every block into its window; each rank copies its own out."""
    if _alone(b):
        return
    p, r, n, root = b.size, b.rank, b.ctx.count, b.ctx.root
    spans = _span(n, _piece(b, n, 2 * p))
    bufs = _buffers(b, p * spans[0][1], len(spans))
    sync = _Sync(b)
    reuse = len(spans) > 2
    for k, (o, m) in enumerate(spans):
        buf = bufs[k % 2]
        if r == root:
            sync.need_all(k - 1)
            for q in range(p):
                if q != root:
                    b.copy(b.inp.sub(q * n + o, m), buf.sub(q * m, m))
            b.post(k + 1)
            b.copy(b.inp.sub(root * n + o, m), b.out.sub(o, m))
        else:
            sync.get(root, buf.sub(r * m, m), b.out.sub(o, m), k + 1)
            if reuse or k == 0:
                b.post(k + 1)
    sync.need_all(1)  # Note [rooted calls agree on the root] in plait.algos._rooted


# -- gather, allgather, alltoall, reduce_scatter ------------------------------------------


def _gather(b: Builder, root: int | None) -> None:
    """Everyone copies its block into its window; every rank (or ``root``) copies all out."""
    if _alone(b):
        return
    p, r, n = b.size, b.rank, b.ctx.count
    spans = _span(n, _piece(b, n, 2))
    bufs = _buffers(b, spans[0][1], len(spans))
    sync = _Sync(b)
    reuse = len(spans) > 2
    last = len(spans) - 1
    for k, (o, m) in enumerate(spans):
        buf = bufs[k % 2].sub(0, m)
        if root is None or r != root:
            # Readers of piece k-2 posted since: allgather's at k (their piece k-1),
            # gather's root at k-1 (after reading piece k-2).
            if root is None:
                sync.need_all(k)
            else:
                sync.need(root, k - 1)
            b.copy(b.inp.sub(o, m), buf)
            b.post(k + 1)
        if root is None or r == root:
            b.copy(b.inp.sub(o, m), b.out.sub(r * n + o, m))
            for q in range(p):
                if q != r:
                    sync.get(q, buf, b.out.sub(q * n + o, m), k + 1)
            if root is not None and (reuse or k == last):
                b.post(k + 1)
    if root is not None and r != root:
        # The root's word that it has read everything (Note [the root's word] in
        # plait.algos._rooted): a rank that only posts would otherwise end first.
        sync.need(root, last + 1)


@register("allgather", "arena", needs_window=True)
def allgather_arena(b: Builder) -> None:
    """Everyone copies its block into its window and every block out of the others'."""
    _gather(b, None)


@register("gather", "arena", needs_window=True)
def gather_arena(b: Builder) -> None:
    """Everyone copies its block into its window; the root copies them all out."""
    _gather(b, b.ctx.root)


def _exchange(b: Builder, reduce: bool) -> None:
    """Everyone copies the blocks meant for others into its window; each reads its own."""
    if _alone(b):
        return
    p, r, n = b.size, b.rank, b.ctx.count
    spans = _span(n, _piece(b, n, 2 * p))
    bufs = _buffers(b, p * spans[0][1], len(spans))
    sync = _Sync(b)
    for k, (o, m) in enumerate(spans):
        buf = bufs[k % 2]
        sync.need_all(k)  # readers of piece k-2 posted k after reading it
        for q in range(p):
            if q != r:
                b.copy(b.inp.sub(q * n + o, m), buf.sub(q * m, m))
        b.post(k + 1)
        if reduce:
            _fold(b, sync, b.out.sub(o, m), b.inp.sub(r * n + o, m), buf.sub(r * m, m), k + 1)
        else:
            b.copy(b.inp.sub(r * n + o, m), b.out.sub(r * n + o, m))
            for q in range(p):
                if q != r:
                    sync.get(q, buf.sub(r * m, m), b.out.sub(q * n + o, m), k + 1)


@register("alltoall", "arena", needs_window=True)
def alltoall_arena(b: Builder) -> None:
    """Everyone copies its outgoing blocks into its window; each copies its own out."""
    _exchange(b, reduce=False)


@register("reduce_scatter", "arena", needs_window=True)
def reduce_scatter_arena(b: Builder) -> None:
    """Everyone copies its blocks into its window; each reduces its own from all."""
    _exchange(b, reduce=True)


@register("barrier", "arena", needs_window=True)
def barrier_arena(b: Builder) -> None:
    """Post, then wait until every other rank has posted."""
    _window_elements(b)  # refuses a call without a window
    post_and_wait_all(b)  # on one rank nothing: the call runs alone, without a post
