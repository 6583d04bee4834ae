"""examples/overlap.py's verdict: a share of the communication hidden, or an honest "no help".

The example's timings themselves are not tested (speed is measured, not asserted).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from examples_loader import load_example

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "overlap.py"


@pytest.fixture(scope="module")
def summary() -> Callable[..., str]:
    return load_example("overlap").summary


def test_a_faster_overlap_hides_a_share_of_the_communication(summary: Callable[..., str]) -> None:
    # the capped-link measurement of docs/training.md
    text = summary(411.0, 310.0, 267.0, ranks=1, cores=16)
    assert (
        text == "overlap step is 0.75 of the serial step: it hides 38 % of the communication time"
    )


@pytest.mark.parametrize(("ranks", "cores"), [(2, 2), (2, 16)])
def test_a_slower_overlap_says_it_did_not_help_and_by_how_much(
    summary: Callable[..., str], ranks: int, cores: int
) -> None:
    text = summary(897.2, 1067.7, 77.4, ranks=ranks, cores=cores)
    assert text.startswith(
        "overlap step is 1.19 of the serial step: overlap did not help here, the overlapped "
        "step took 19 % (170.5 ms) longer than the serial one.\n"
    )
    assert "hides" not in text
    assert not re.search(r"-\d", text), text  # no negative number anywhere


def test_the_reason_given_depends_on_spare_cores(summary: Callable[..., str]) -> None:
    crowded = summary(900.0, 950.0, 80.0, ranks=2, cores=2)
    assert "2 ranks on 2 cores leave no core free for the background threads" in crowded
    spare = summary(900.0, 950.0, 80.0, ranks=2, cores=16)
    assert "no core free" not in spare
    assert "costs CPU time and memory bandwidth" in spare
    for text in (crowded, spare):
        assert text.endswith("Overlap pays where communication waits on a network.")


def test_a_tie_is_no_help_either(summary: Callable[..., str]) -> None:
    text = summary(900.0, 901.0, 80.0, ranks=2, cores=2)
    assert "overlap did not help here, the overlapped step took as long as the serial one" in text
    assert "(1.0 ms longer)" in text
    assert "did not help" in summary(900.0, 900.0, 80.0, ranks=2, cores=2)


def test_savings_beyond_the_communication_time_are_flagged_as_noise(
    summary: Callable[..., str],
) -> None:
    text = summary(900.0, 700.0, 77.0, ranks=2, cores=16)
    assert "it saved 200.0 ms, more than the 77.0 ms the communication alone takes" in text
    assert "%" not in text


def test_every_verdict_keeps_the_line_the_launch_tests_look_for(
    summary: Callable[..., str],
) -> None:
    for overlap in (500.0, 899.0, 900.0, 1200.0):
        assert summary(900.0, overlap, 300.0, ranks=2, cores=2).startswith("overlap step is ")
