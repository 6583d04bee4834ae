"""``plait.restart_count()``: which attempt of a restarted job this process belongs to."""

from __future__ import annotations

import pytest

import plait


def test_zero_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLAIT_RESTART_COUNT", raising=False)
    assert plait.restart_count() == 0
    monkeypatch.setenv("PLAIT_RESTART_COUNT", "")
    assert plait.restart_count() == 0


def test_reads_the_attempt_plait_run_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_RESTART_COUNT", "2")
    assert plait.restart_count() == 2


@pytest.mark.parametrize("text", ["-1", "one", "1.5", "²"])  # ²: isdigit, but not int()
def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("PLAIT_RESTART_COUNT", text)
    with pytest.raises(ValueError, match="PLAIT_RESTART_COUNT"):
        plait.restart_count()
