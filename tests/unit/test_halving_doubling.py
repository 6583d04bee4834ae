"""The pure rank arithmetic behind recursive halving, recursive doubling and Rabenseifner.

Block ownership is checked by simulating the plans alone (no builder), for
powers of two and, through :func:`fold_spans`, for every other size.
"""

from __future__ import annotations

import itertools

import pytest

from plait.algos import get
from plait.algos._registry import build_schedule
from plait.algos.rabenseifner import doubling_plan, fold_spans, gather_plan, halving_plan
from plait.algos.topology import fold, pof2_floor, unfold
from plait.schedule.builder import Context

POF2S = [1 << m for m in range(8)]


@pytest.mark.parametrize("pof2", POF2S)
def test_halving_plan_ends_with_own_block(pof2: int) -> None:
    plans = [halving_plan(v, pof2) for v in range(pof2)]
    for v, plan in enumerate(plans):
        assert len(plan) == pof2.bit_length() - 1
        window = (0, pof2)
        for step, (pv, kept, given) in enumerate(plan):
            # The two halves split the current window, and v stays in the kept one.
            assert sorted([kept, given]) == [
                (window[0], (window[0] + window[1]) // 2),
                ((window[0] + window[1]) // 2, window[1]),
            ]
            assert kept[0] <= v < kept[1]
            # The partner keeps what v gives and gives what v keeps.
            assert plans[pv][step] == (v, given, kept)
            window = kept
        assert window == (v, v + 1)


@pytest.mark.parametrize("pof2", POF2S)
def test_doubling_plan_gathers_everything(pof2: int) -> None:
    plans = [doubling_plan(v, pof2) for v in range(pof2)]
    for v, plan in enumerate(plans):
        held = (v, v + 1)
        for step, (pv, sent, received) in enumerate(plan):
            assert sent == held
            assert plans[pv][step] == (v, received, sent)
            held = (min(sent[0], received[0]), max(sent[1], received[1]))
            assert held[1] - held[0] == sent[1] - sent[0] + received[1] - received[0]
        assert held == (0, pof2)


@pytest.mark.parametrize("pof2", POF2S)
def test_halving_then_doubling_is_reversed_hypercube(pof2: int) -> None:
    for v in range(pof2):
        halving = [(pv, kept) for pv, kept, _ in halving_plan(v, pof2)]
        doubling = [(pv, sent) for pv, sent, _ in doubling_plan(v, pof2)]
        # At each distance, doubling sends exactly the window halving kept there.
        assert doubling == halving[::-1]


@pytest.mark.parametrize("pof2", POF2S)
def test_gather_plan_collects_every_block_at_any_root(pof2: int) -> None:
    for vroot in range(pof2):
        plans = [gather_plan(v, vroot, pof2) for v in range(pof2)]
        held = {v: {v} for v in range(pof2)}
        for step in range(pof2.bit_length() - 1):
            for v, plan in enumerate(plans):
                if step >= len(plan) or plan[step][1]:
                    continue
                pv, _, window = plan[step]
                # The sender sends at this very step, exactly the window it holds.
                assert plans[pv][step] == (v, True, window)
                assert held[pv] == set(range(*window))
                assert len(plans[pv]) == step + 1
                held[v] |= held.pop(pv)
        assert held == {vroot: set(range(pof2))}
        for v, plan in enumerate(plans):
            sends = [s for _, s, _ in plan]
            assert sends.count(True) == (0 if v == vroot else 1)
            assert not any(sends[:-1])


@pytest.mark.parametrize("size", range(1, 41))
def test_fold_spans_give_every_real_block_one_virtual_owner(size: int) -> None:
    spans = fold_spans(size)
    pof2 = pof2_floor(size)
    assert len(spans) == pof2
    assert spans[0][0] == 0
    assert spans[-1][1] == size
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end == start
    for q in range(size):
        owners = [j for j, (lo, hi) in enumerate(spans) if lo <= q < hi]
        v = fold(q, size)
        assert owners == [v if v is not None else fold(q + 1, size)]
    for j, (lo, hi) in enumerate(spans):
        assert lo <= unfold(j, size) < hi
        assert hi - lo in (1, 2)
    if size == pof2:
        assert spans == [(q, q + 1) for q in range(size)]


def test_fold_spans_examples() -> None:
    assert fold_spans(4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert fold_spans(5) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert fold_spans(6) == [(0, 2), (2, 4), (4, 5), (5, 6)]


@pytest.mark.parametrize(
    ("collective", "name"),
    [
        ("allreduce", "rabenseifner"),
        ("reduce", "rabenseifner"),
        ("reduce_scatter", "recursive_halving"),
    ],
)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 32, 33, 64, 100])
def test_steps_per_rank_are_logarithmic(collective: str, name: str, size: int) -> None:
    spec = get(collective, name)
    lg = size.bit_length()
    for rank in {0, 1 % size, size // 2, size - 1}:
        for root in {0, size - 1}:
            ctx = Context(collective, rank, size, 131, root=root)
            steps = build_schedule(spec, ctx).steps
            # Per exchange at most a send and a receive, plus fold, copies and unfold.
            assert len(steps) <= 4 * lg + 6, (rank, root, len(steps))
