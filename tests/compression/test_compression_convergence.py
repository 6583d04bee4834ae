"""Convergence: data-parallel training on 4 ranks with each compressor stays within 1 point.

Trains examples/compression.py's MLP on scikit-learn's digits (shipped with
scikit-learn, nothing downloaded; the tests skip without it) with threads as
ranks, and compares each method's test accuracy with the uncompressed run's.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from examples_loader import load_example
from plait.testing import run_ranks

pytest.importorskip("sklearn", reason="the digits data set comes with scikit-learn")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "compression.py"
STEPS = 400


def _example() -> ModuleType:
    return load_example("compression")


def _train(method: str) -> Any:
    example = _example()
    # No shared window: messages only, so bytes on the wire compare (as the example runs).
    results = run_ranks(4, lambda comm: example.train(comm, method, steps=STEPS), window=0)
    for r in results:
        assert r.identical, f"{method}: replicas differ"
        assert (r.accuracy, r.bytes_sent) == (results[0].accuracy, results[0].bytes_sent)
    return results[0]


@pytest.fixture(scope="module")
def baseline() -> Any:
    return _train("none")


@pytest.mark.parametrize(
    "method", ["fp16", "bf16", "int8", "int8-stochastic", "topk-1%", "powersgd-r1"]
)
def test_accuracy_within_one_point_of_uncompressed(method: str, baseline: Any) -> None:
    assert baseline.accuracy > 0.95
    res = _train(method)
    assert res.accuracy >= baseline.accuracy - 0.01, (
        f"{method}: {res.accuracy:.4f} vs uncompressed {baseline.accuracy:.4f}"
    )
    assert res.bytes_sent < baseline.bytes_sent / 1.9
