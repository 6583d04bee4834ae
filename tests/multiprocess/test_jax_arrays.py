"""JAX arrays between real processes: ``jax_check.py`` under ``plait run`` on 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_multiprocess import plait_run

pytest.importorskip("jax", reason="JAX arrays need jax: pip install jax")

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(120)
def test_jax_arrays_through_the_collectives_and_the_example() -> None:
    res = plait_run(["-n", "2", str(HERE / "jax_check.py")], timeout=100)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "jax ok on 2 ranks" in res.stdout
    assert "replicas identical: True" in res.stdout
