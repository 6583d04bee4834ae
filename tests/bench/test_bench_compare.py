"""``plait bench --compare``: the same sweep through Open MPI (mpi4py) and torch's gloo.

Each system's test skips, saying what to install, where it is missing;
without either, the bench itself must say so and still print plait's table.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import assert_clean_table, bench, series, tables

from plait.bench import runner

MPI_MISSING = runner.mpi_missing()
GLOO_MISSING = runner.gloo_missing()


@pytest.mark.skipif(MPI_MISSING is not None, reason=f"Open MPI comparison: {MPI_MISSING}")
def test_compare_with_open_mpi_over_shared_memory_and_tcp(tmp_path: Path) -> None:
    res, doc = bench("-n 3 -b 0 -e 3K -f 8 --in-place --compare mpi", tmp_path)
    assert res.returncode == 0, res.stderr
    assert_clean_table(res.stdout)
    assert doc is not None
    assert [s["label"] for s in doc["series"]] == ["plait", "mpi-shm", "mpi-tcp"]
    plait_rows = series(doc, "plait")["rows"]
    for label in ("mpi-shm", "mpi-tcp"):
        s = series(doc, label)
        assert (s["error"], s["skipped"]) == (None, None), s
        assert "Open MPI" in s["info"]["mpi"]
        assert [r["bytes"] for r in s["rows"]] == [r["bytes"] for r in plait_rows]
        for mine, theirs in zip(plait_rows, s["rows"], strict=True):
            assert theirs["wrong"] == 0
            assert theirs["algorithm"] == "ompi"
            assert theirs["plait_ratio"] == pytest.approx(theirs["time_us"] / mine["time_us"])
    text = tables(res.stdout)
    assert set(text) == {"plait", "mpi-shm", "mpi-tcp"}
    assert "plait/mpi-shm" in res.stdout
    assert "# compared with Open MPI" in res.stdout


@pytest.mark.skipif(MPI_MISSING is not None, reason=f"Open MPI comparison: {MPI_MISSING}")
def test_rooted_collective_and_a_dtype_mpi_lacks(tmp_path: Path) -> None:
    res, doc = bench("gather -n 2 -r 1 -b 8 -e 512 -f 8 --compare mpi", tmp_path)
    assert res.returncode == 0, res.stderr
    assert doc is not None
    assert all(r["wrong"] == 0 for s in doc["series"] for r in s["rows"])
    assert len(series(doc, "mpi-tcp")["rows"]) == 3
    res, doc = bench("-n 2 -d float16 -e 64 --compare mpi", tmp_path)
    assert res.returncode == 0, res.stderr
    assert doc is not None
    assert series(doc, "mpi-shm")["skipped"] == "MPI has no datatype for float16"
    assert "# skipped: MPI has no datatype for float16" in res.stdout


@pytest.mark.skipif(GLOO_MISSING is not None, reason=f"gloo comparison: {GLOO_MISSING}")
def test_compare_with_gloo(tmp_path: Path) -> None:
    res, doc = bench("reduce_scatter -n 2 -b 8 -e 4K -f 8 --compare gloo", tmp_path)
    assert res.returncode == 0, res.stderr
    assert_clean_table(res.stdout)
    assert doc is not None
    s = series(doc, "gloo")
    assert (s["error"], s["skipped"]) == (None, None), s
    assert s["info"]["torch"].startswith("2.")
    assert [r["bytes"] for r in s["rows"]] == [8, 64, 512, 4096]
    assert all(r["wrong"] == 0 and r["plait_ratio"] > 0 for r in s["rows"])
    assert "plait/gloo" in res.stdout


def test_missing_systems_are_skipped_with_a_reason(tmp_path: Path) -> None:
    """No mpirun on PATH, a torch that fails to import: the bench says why and goes on."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    env = {"PATH": str(tmp_path / "no-bin"), "PYTHONPATH": str(fake)}
    res, doc = bench("-n 2 -b 8 -e 8 --compare mpi,gloo", tmp_path, env)
    assert res.returncode == 0, res.stderr
    assert doc is not None
    assert [s["label"] for s in doc["series"]] == ["plait", "mpi-shm", "mpi-tcp", "gloo"]
    assert series(doc, "mpi-shm")["skipped"].startswith("mpirun is not installed (apt-get install")
    assert "torch" in series(doc, "gloo")["skipped"]
    assert "# skipped: mpirun is not installed" in res.stdout
    assert len(tables(res.stdout)["plait"]) == 1
