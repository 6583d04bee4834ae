"""The pure rank arithmetic of the binomial, scatter-allgather and dissemination modules.

Sizes that are and are not powers of two; the schedules themselves are proven
in ``test_symbolic.py``, here only a few structural counts are checked.
"""

from __future__ import annotations

import math

import pytest

from plait.algos._registry import build_schedule, get
from plait.algos.binomial import relative_group, subtree_size, wrap_runs
from plait.algos.dissemination import dissemination_peers
from plait.algos.topology import binomial_children
from plait.schedule.builder import Context
from plait.schedule.ir import Schedule, StepKind

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 31, 32, 33]


def test_subtree_size_examples() -> None:
    assert [subtree_size(v, 6) for v in range(6)] == [6, 1, 2, 1, 2, 1]
    assert [subtree_size(v, 8) for v in range(8)] == [8, 1, 2, 1, 4, 1, 2, 1]
    assert subtree_size(0, 1) == 1


@pytest.mark.parametrize("size", SIZES)
def test_subtrees_partition(size: int) -> None:
    # A subtree is its root followed by its children's subtrees, back to back.
    for v in range(size):
        n = subtree_size(v, size)
        assert 1 <= n <= size - v
        nxt = v + 1
        for child in binomial_children(v, size):
            assert child == nxt
            nxt += subtree_size(child, size)
        assert nxt == v + n


def test_relative_group() -> None:
    assert relative_group(0, 4) == [0, 1, 2, 3]
    assert relative_group(3, 5) == [3, 4, 0, 1, 2]
    for size in SIZES:
        for root in {0, size // 2, size - 1}:
            group = relative_group(root, size)
            assert group[0] == root
            assert sorted(group) == list(range(size))


def test_wrap_runs_examples() -> None:
    assert wrap_runs(2, 4, 1, 4) == [(2, 3), (3, 4)]
    assert wrap_runs(1, 3, 1, 4) == [(1, 3)]
    assert wrap_runs(0, 4, 0, 4) == [(0, 4)]
    assert wrap_runs(3, 3, 1, 4) == []
    assert wrap_runs(1, 5, 3, 5) == [(1, 2), (2, 5)]  # ranks 4 | 0, 1, 2


@pytest.mark.parametrize("size", SIZES)
def test_wrap_runs_are_contiguous_in_real_ranks(size: int) -> None:
    for root in range(size):
        for lo in range(size):
            for hi in range(lo, size + 1):
                runs = wrap_runs(lo, hi, root, size)
                assert len(runs) <= 2
                # The runs tile [lo, hi) in order ...
                assert [x for a, b in runs for x in range(a, b)] == list(range(lo, hi))
                # ... and each is a contiguous, increasing range of real ranks.
                for a, b in runs:
                    real = [(v + root) % size for v in range(a, b)]
                    assert real == list(range(real[0], real[0] + b - a))


def test_dissemination_peers_examples() -> None:
    assert dissemination_peers(0, 1) == []
    assert dissemination_peers(0, 2) == [(1, 1)]
    assert dissemination_peers(0, 5) == [(1, 4), (2, 3), (4, 1)]
    assert dissemination_peers(3, 4) == [(0, 2), (1, 1)]


@pytest.mark.parametrize("size", SIZES)
def test_dissemination_peers_match_and_spread(size: int) -> None:
    rounds = [dissemination_peers(r, size) for r in range(size)]
    assert all(len(x) == math.ceil(math.log2(size)) for x in rounds)
    # What rank r sends in round k is what its target receives in round k.
    for r in range(size):
        for k, (to, _) in enumerate(rounds[r]):
            assert rounds[to][k][1] == r
    # Each round passes on all that was heard before it: after the last, all know all.
    heard = [{r} for r in range(size)]
    for k in range(len(rounds[0])):
        heard = [heard[r] | heard[rounds[r][k][1]] for r in range(size)]
    assert all(h == set(range(size)) for h in heard)


def _schedules(collective: str, name: str, size: int, count: int, root: int = 0) -> list[Schedule]:
    spec = get(collective, name)
    return [
        build_schedule(spec, Context(collective, r, size, count, 1, True, root, 0))
        for r in range(size)
    ]


@pytest.mark.parametrize("size", SIZES)
def test_barrier_sends_one_token_per_round(size: int) -> None:
    for sched in _schedules("barrier", "dissemination", size, 0):
        sends = [s for s in sched.steps if s.kind is StepKind.SEND]
        assert len(sends) == math.ceil(math.log2(size))
        assert all(s.count == 1 for s in sends)


@pytest.mark.parametrize("collective", ["gather", "scatter"])
@pytest.mark.parametrize("size", SIZES)
def test_root_moves_at_most_one_extra_message(collective: str, size: int) -> None:
    # Unsegmented, the root talks to each child once, plus once for the wrapped subtree.
    for root in {0, size // 2, size - 1}:
        sched = _schedules(collective, "binomial", size, 3, root)[root]
        # A scatter's root also hears from its witness (Note [rooted calls agree on the root]),
        # and a gather's root sends its word to each child once it has everything (Note [the
        # root's word]): count only the data's direction.
        kind = StepKind.SEND if collective == "scatter" else StepKind.RECV
        messages = [s for s in sched.steps if s.kind is kind]
        children = len(binomial_children(0, size))
        assert children <= len(messages) <= children + (1 if root else 0)
