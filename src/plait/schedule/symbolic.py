"""Prove a collective's postcondition by running its schedules on provenance values.

Every input element starts as ``((rank, index),)``: which rank contributed it
and from which position. Copies move these tuples and reductions concatenate
them in operand order, so at the end each output element says exactly which
contributions it holds and in what order. Beside it travels the association
tree (``((0, 1), (2, 3))``: nested pairs with rank numbers at the leaves, shared
between the elements made from them, so a reduction costs a pair, not a copy
of the tree); for allreduce it must be the same on every rank, so
floating-point results are bit-identical across ranks. :func:`prove` then checks the
collective's postcondition on every rank: e.g. for allreduce, element ``i``
must be ``((0, i), (1, i), …, (p-1, i))`` (any order if the op is commutative,
exactly rank order if not), and for a barrier every rank must have heard,
directly or transitively, from every other before it finishes.

Beside the data, :func:`must_hear` says whom a rank must have heard from before it
ends so that ranks which disagree on the call find out (every message and post
carries the call's digest, which its reader compares): the root of a broadcast,
scatter or scatterv its witness, every rank of a reduce, gather, gatherv or a
call whose result every rank shares every other (the root's word, the tokens
of ranks without rows), and every rank of a call that moves nothing every other.
Data alone does not show it: a builder that dropped the witness's message, the
root's word or a token still gives every rank its result. ``prove(...,
agreement=True)`` checks it, as the proofs of the registered algorithms do; a
schedule written to exercise one rule of the verifier need not carry these.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from plait.collectives import Collective
from plait.collectives import get as _collective
from plait.schedule.builder import Builder, Context, Fabric, HostLayout, record
from plait.schedule.ir import Schedule
from plait.schedule.verify import ScheduleError, check_hosts, run_joint

__all__ = ["Recipe", "expected", "must_hear", "prove", "witness"]

Prov = tuple[tuple[int, int], ...]


class Recipe(Protocol):
    """What :func:`prove` needs of an algorithm: its collective, its name and its builder.

    :class:`plait.algos.AlgorithmSpec` is one; so is any small object a test makes.
    """

    @property
    def collective(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def build(self) -> Callable[[Builder], None]: ...


#: How :func:`prove` gets one rank's schedule: ``(recipe, context) -> Schedule``.
BuildSchedule = Callable[[Any, Context], Schedule]


def _record(recipe: Recipe, ctx: Context) -> Schedule:
    return record(recipe.build, ctx)


@functools.lru_cache(maxsize=1 << 16)
def _reduced(size: int, index: int) -> Prov:
    return tuple((r, index) for r in range(size))


def expected(
    collective: str,
    size: int,
    count: int,
    rank: int,
    root: int,
    counts: tuple[int, ...] | None = None,
) -> list[Prov] | None:
    """The provenance ``OUT`` must hold on ``rank``; None if the call returns nothing there.

    Read from the collective's pieces (:meth:`plait.collectives.Collective.output_pieces`,
    ``counts`` for an uneven call): a copied element is ``((source, index),)``, a
    reduced one every rank's ``(rank, index)`` in rank order.
    """
    pieces = _collective(collective).output_pieces(size, count, rank, root, counts)
    if pieces is None:
        return None
    out: list[Prov] = []
    for piece in pieces:
        lo = piece.src_offset
        if piece.reduced:
            out += [_reduced(size, lo + i) for i in range(piece.length)]
        else:
            (q,) = piece.sources
            out += [((q, lo + i),) for i in range(piece.length)]
    return out


def witness(root: int, size: int) -> int:
    """The rank the root of a broadcast, scatter or scatterv must hear from: rank 0, or rank 1
    where the root is 0 (Note [rooted calls agree on the root] in :mod:`plait.algos._rooted`).

    Stated here again, not imported: the prover sits below the algorithms and states what
    they must do; ``tests/unit/test_symbolic.py`` checks that both name the same rank.
    ``size`` must be at least 2."""
    return 1 if root == 0 else 0


def must_hear(
    collective: str, size: int, rank: int, root: int, moves: bool
) -> tuple[frozenset[int], str]:
    """The ranks whose start must happen-before ``rank``'s end, and the rule that says so.

    What a rank's result holds shows whom it heard from; this is what it must also
    have heard where the result does not show it, so that a rank which disagrees
    with it on the call (another root, other counts, another collective) is not
    left unseen: each message and post it reads carries a digest it compares.
    ``moves``: whether the call moves any element (an uneven call: any count).

    * A barrier: every rank (its whole postcondition).
    * A call of more than one rank that moves nothing meets its peers as a
      barrier does (Note [empty calls meet] in :mod:`plait.algos._presence`):
      every rank.
    * A call whose result is at the root only (reduce, gather, gatherv) ends with
      the root's word once it has everything, and a gatherv rank without rows
      sends a token (Note [the root's word] in :mod:`plait.algos._rooted`): every
      rank.
    * A call whose result every rank shares and that has no root (allreduce,
      allgather, allgatherv): every rank, an allgatherv rank without rows by its
      token.
    * A call that moves data out of the root (broadcast, scatter, scatterv): the
      root hears its :func:`witness` (Note [rooted calls agree on the root]).
    * A reduce_scatterv: every rank, a rank without rows by a token from each
      rank (its counts are given on every rank, not exchanged).
    * The others (reduce_scatter, alltoall, alltoallv, whose counts an allgather
      has already agreed): nothing beyond their data.
    """
    table = _collective(collective)
    everyone = frozenset(range(size))
    if size == 1:
        return frozenset(), ""
    if table.synchronizes:
        return everyone, "a barrier"
    if not moves:
        return everyone, "a call that moves nothing meets its peers"
    if table.rooted:
        other = (root + 1) % size
        if table.output_pieces(size, 0, other, root, _zeros(table, size)) is None:
            return everyone, "the root's word"
        if rank == root:
            return frozenset({witness(root, size)}), "the root's witness"
        return frozenset(), ""
    if table.replicated:
        return everyone, "a result every rank shares"
    if collective == "reduce_scatterv":
        return everyone, "a rank without rows hears a token from every rank"
    return frozenset(), ""


def _zeros(table: Collective, size: int) -> tuple[int, ...] | None:
    """All-zero counts for an uneven collective (None for an even one): only the shape of
    its result on a rank, not its length, is asked of them."""
    return None if table.uneven is None else (0,) * table.uneven.length(size)


#: An association tree: a rank number, or the pair of trees a reduction combined.
Tree = int | tuple[Any, Any]


def _combine(a: tuple[Prov, Tree], b: tuple[Prov, Tree]) -> tuple[Prov, Tree]:
    # (contributions in operand order, association tree with rank numbers at the leaves)
    return a[0] + b[0], (a[1], b[1])


def _leaves(rank: int, n: int) -> list[Any]:
    """``rank``'s ``n`` input elements: ``(((rank, i),), rank)`` for each position ``i``."""
    return list(_leaf_values(rank, n))


@functools.lru_cache(maxsize=1 << 12)
def _leaf_values(rank: int, n: int) -> tuple[Any, ...]:
    # Made once per (rank, n) and shared: the values are immutable, the buffers fresh lists.
    return tuple((((rank, i),), rank) for i in range(n))


def _tree_text(tree: Tree) -> str:
    """``tree`` as the messages show it: ``((0 1) (2 3))``."""
    if isinstance(tree, int):
        return str(tree)
    return f"({_tree_text(tree[0])} {_tree_text(tree[1])})"


def prove(
    spec: Recipe,
    size: int,
    count: int,
    *,
    root: int = 0,
    commutative: bool = True,
    segment: int = 0,
    in_place: bool = False,
    hosts: Sequence[int] | None = None,
    fabric: Fabric | None = None,
    counts: Sequence[int] | None = None,
    build: BuildSchedule = _record,
    window: int = 1 << 40,
    itemsize: int = 1,
    agreement: bool = False,
) -> None:
    """Build ``spec`` for every rank and check its postcondition; ScheduleError if it fails.

    ``hosts`` gives the host index of every rank (None: one host); ``fabric``
    the aggregating switches, whose schedules run along (``in_network``).
    ``in_place`` runs with ``OUT`` aliasing ``IN`` (for collectives where the two
    have the same length on that rank), as an ``out=x`` call does. ``build``
    gets one rank's schedule from ``spec`` and a :class:`Context`: by default
    the builder runs afresh; the registry passes its cached
    :func:`plait.algos._registry.build_schedule`, which the executor runs.
    ``counts``: an uneven collective's per-rank counts (``Context.counts``;
    ``count`` is then not read). ``window``: the bytes of ``SHARED`` each rank
    may use (``Context.window``; ``window // itemsize`` elements); every
    rank's window starts unwritten (``None``), so a ``GET`` of what its owner
    never wrote before publishing it fails the proof. ``itemsize``: the bytes of
    one element as the builders see it (``Context.itemsize``); a builder that
    picks a branch by bytes (hierarchical's inner algorithm above
    ``INNER_RD_BYTES``) takes the one a call of that dtype takes, while each
    element is still one provenance value. ``agreement``: also check that every
    rank heard from whom :func:`must_hear` names, before it ends (a barrier is
    always checked so).

    Raises:
        ScheduleError: the schedules break a rule or the postcondition.
        ValueError: ``size`` below 1, ``root`` not a rank, a negative ``count`` or an
            ``itemsize`` below 1: a call no communicator makes (a root of -1 was proven as a
            reduce that returns nothing).
    """
    if size < 1:
        raise ValueError(f"size must be at least 1; got {size}")
    if not 0 <= root < size:
        raise ValueError(f"root must be a rank, in 0..{size - 1}; got {root}")
    if counts is None and count < 0:
        raise ValueError(f"count must be >= 0; got {count}")
    if itemsize < 1:
        raise ValueError(f"itemsize must be at least 1; got {itemsize}")
    c = spec.collective
    table = _collective(c)
    layout = HostLayout(hosts) if hosts is not None else None
    table.check_counts(size, counts)
    given = tuple(int(n) for n in counts) if counts is not None else None
    ctx = Context(
        c, 0, size, count, itemsize, commutative, root, segment, layout, fabric, given, window
    )
    scheds = [build(spec, ctx.with_rank(r)) for r in range(ctx.participants)]
    buffers: list[list[list[Any]]] = []
    for r, s in enumerate(scheds):
        inp: list[Any] = _leaves(r, s.in_count)
        if table.fills_x:  # root's data starts in OUT; junk elsewhere must be overwritten
            out: list[Any] = _leaves(r, s.out_count) if r == root else [("junk", r)] * s.out_count
        elif in_place and s.in_count == s.out_count:
            out = inp
        else:
            out = [None] * s.out_count
        buffers.append([inp, out, [None] * s.tmp_count, [None] * s.shared_count])
    where = f"{c}/{spec.name} size={size} count={count} root={root} commutative={commutative}"
    if itemsize != 1:
        where += f" itemsize={itemsize}"
    if hosts is not None:
        where += f" hosts={list(hosts)}"
    if given is not None:
        where += f" counts={list(given)}"
    try:
        if hosts is not None:
            check_hosts(scheds, hosts)
        seen = run_joint(scheds, buffers, _combine)
    except ScheduleError as exc:
        raise ScheduleError(f"{where}: {exc}") from None
    for r in range(size):
        want = expected(c, size, count, r, root, given)
        if want is None:
            continue
        out = buffers[r][1]
        # A value is (contributions, tree); junk is ("junk", rank), an unwritten element None.
        got = [v[0] if type(v) is tuple and type(v[0]) is tuple else v for v in out]
        if len(got) != len(want):
            raise ScheduleError(
                f"{where}: rank {r} OUT has {len(got)} elements, expected {len(want)}"
            )
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            # w lists contributions in rank order, so a sorted g must equal it.
            ok = g == w or (commutative and isinstance(g, tuple) and sorted(g) == list(w))
            if not ok:
                raise ScheduleError(f"{where}: rank {r} OUT[{i}] = {g}, expected {w}")
        if table.reduces and table.replicated and r > 0:
            # Same association and operand order everywhere: bit-identical floats.
            for i, (mine, first) in enumerate(zip(out, buffers[0][1], strict=True)):
                if mine[1] != first[1]:
                    raise ScheduleError(
                        f"{where}: OUT[{i}] is computed as {_tree_text(mine[1])} on rank {r} "
                        f"but as {_tree_text(first[1])} on rank 0; results would differ in the "
                        "last bits"
                    )
    if agreement or table.synchronizes:
        moves = count > 0 if given is None else any(given)
        for r in range(size):
            need, rule = must_hear(c, size, r, root, moves)
            if not need <= seen[r]:
                missing = sorted(need - seen[r])
                raise ScheduleError(
                    f"{where}: rank {r} can leave before hearing from {missing} ({rule})"
                )
