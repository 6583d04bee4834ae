"""``auto`` picks a supported algorithm from values all ranks share, by size and ranks."""

from __future__ import annotations

import pytest

from plait.algos._registry import COLLECTIVES, get
from plait.selection.select import RULES, select


def test_rules_name_registered_algorithms() -> None:
    assert set(RULES) == set(COLLECTIVES)
    for c, rules in RULES.items():
        for rule in rules:
            for name in rule.algorithms:
                get(c, name)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("commutative", [True, False])
def test_always_a_supported_choice(collective: str, commutative: bool) -> None:
    for size in (1, 2, 3, 8, 17, 64, 1000):
        for nbytes in (0, 8, 4096, 65536, 1 << 20, 1 << 30):
            spec = select(collective, size, nbytes, commutative=commutative)
            assert spec.collective == collective
            assert spec.supports(commutative=commutative)


def test_small_and_large_messages() -> None:
    assert select("allreduce", 8, 8, commutative=True).name == "recursive_doubling"
    assert select("allreduce", 8, 256 << 10, commutative=True).name == "recursive_doubling"
    assert select("allreduce", 8, 64 << 20, commutative=True).name == "direct"  # few ranks
    assert select("allreduce", 16, 64 << 20, commutative=True).name == "rabenseifner"
    assert select("allreduce", 12, 64 << 20, commutative=True).name == "ring"  # not a power of 2
    assert select("allreduce", 64, 256 << 10, commutative=True).name == "rabenseifner"
    assert select("allreduce", 8, 64 << 20, commutative=False).name == "direct"
    assert select("broadcast", 4, 64 << 20, commutative=True).name == "binomial"
    assert select("broadcast", 16, 64 << 20, commutative=True).name == "scatter_allgather"
    assert select("reduce_scatter", 4, 64 << 20, commutative=False).name == "pairwise"


def test_more_ranks_than_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """One host running more ranks than it has cores: binomial for small allreduces."""
    from plait.selection import select as sel

    monkeypatch.setattr(sel, "_cores", lambda: 2)
    assert select("allreduce", 4, 8, commutative=True).name == "binomial"
    assert select("allreduce", 4, 512 << 10, commutative=True).name == "binomial"
    assert select("allreduce", 4, 1 << 20, commutative=True).name == "direct"
    assert select("allreduce", 2, 8, commutative=True).name == "recursive_doubling"  # fits
    from plait.schedule.builder import HostLayout

    spread = HostLayout([0, 0, 1, 1])  # across hosts the rule does not apply
    assert select("allreduce", 4, 8, commutative=True, hosts=spread).name != "binomial"


def test_host_aware_choices() -> None:
    from plait.schedule.builder import HostLayout

    two_hosts = HostLayout([0, 0, 1, 1])
    assert select("allreduce", 4, 1 << 20, commutative=True, hosts=two_hosts).name == (
        "hierarchical"
    )
    assert select("allreduce", 4, 64 << 20, commutative=True, hosts=two_hosts).name == "cascade"
    assert select("allreduce", 4, 8, commutative=True, hosts=two_hosts).name == (
        "recursive_doubling"
    )
    assert select("allreduce", 4, 64 << 20, commutative=False, hosts=two_hosts).name == "direct"
    assert select("allreduce", 4, 64 << 20, commutative=True).name == "direct"  # one host
    assert select("allreduce", 32, 64 << 20, commutative=True).name == "rabenseifner"
    assert select("allreduce", 24, 64 << 20, commutative=True).name == "ring"
