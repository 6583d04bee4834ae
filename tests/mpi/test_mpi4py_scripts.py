"""The mpi4py scripts of examples/mpi4py/, unchanged, under real mpi4py and under plait.mpi.

Every script runs in one job per side (``run_scripts.py``: one start-up each), four ranks:
``mpirun -np 4`` with mpi4py and an MPI library, and ``plait run -n 4 --mpi4py``, where
``from mpi4py import MPI`` imports plait.mpi. Each rank's output of each script must be the
same. The mpirun side skips when mpi4py or mpirun is missing; the plait side always runs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[1] / "examples" / "mpi4py"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))
RANKS = 4
PLAIT = [sys.executable, "-m", "plait"]
MPIRUN = shutil.which("mpirun")
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None


def _outputs(folder: Path) -> dict[tuple[str, int], str]:
    return {
        (p.name.split(".")[0], int(p.name.split(".")[1])): p.read_text()
        for p in folder.glob("*.txt")
    }


def _run_all(command: list[str], out: Path) -> dict[tuple[str, int], str]:
    out.mkdir()
    res = subprocess.run(
        [*command, str(HERE / "run_scripts.py"), str(out), *SCRIPTS],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return _outputs(out)


@pytest.fixture(scope="module")
def plait_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], str]:
    out = tmp_path_factory.mktemp("plait") / "out"
    return _run_all([*PLAIT, "run", "-n", str(RANKS), "--mpi4py"], out)


@pytest.fixture(scope="module")
def mpi4py_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], str]:
    if MPIRUN is None or not HAVE_MPI4PY:
        pytest.skip("needs mpi4py and Open MPI's mpirun (pip install mpi4py; openmpi-bin)")
    out = tmp_path_factory.mktemp("mpi4py") / "out"
    flags = ["--allow-run-as-root", "--oversubscribe"]
    return _run_all([MPIRUN, *flags, "-np", str(RANKS), sys.executable], out)


def test_every_script_runs_on_plait(plait_outputs: dict[tuple[str, int], str]) -> None:
    assert SCRIPTS, f"no scripts in {EXAMPLES}"
    for script in SCRIPTS:
        stem = script.removesuffix(".py")
        for rank in range(RANKS):
            assert (stem, rank) in plait_outputs, f"{script} wrote nothing on rank {rank}"
        assert plait_outputs[stem, 0], f"{script} printed nothing on rank 0"


@pytest.mark.parametrize("script", SCRIPTS)
def test_same_output_as_mpi4py(
    script: str,
    plait_outputs: dict[tuple[str, int], str],
    mpi4py_outputs: dict[tuple[str, int], str],
) -> None:
    stem = script.removesuffix(".py")
    for rank in range(RANKS):
        assert plait_outputs[stem, rank] == mpi4py_outputs[stem, rank], f"{script}, rank {rank}"


FAILING = """
from plait import mpi as MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank)
print("total", total, flush=True)
if comm.rank == 1:
    raise RuntimeError("boom on rank 1")
comm.Barrier()  # the others wait here for rank 1, which never comes
"""


def test_an_uncaught_exception_ends_the_job(tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    start = time.monotonic()
    res = subprocess.run(
        [*PLAIT, "run", "-n", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PLAIT_TIMEOUT": "60"},
    )
    assert res.returncode != 0
    assert "RuntimeError: boom on rank 1" in res.stderr
    assert res.stdout.count("total 3") == 3
    assert time.monotonic() - start < 30, "the job waited for a deadline instead of ending"


def test_the_mpi4py_package_is_plait_mpi(tmp_path: Path) -> None:
    """What ``--mpi4py`` puts on the path: ``from mpi4py import MPI`` is plait.mpi itself."""
    from plait.mpi import mpi4py_path

    check = (
        "import mpi4py, plait.mpi\n"
        "from mpi4py import MPI\n"
        "assert MPI is plait.mpi, MPI\n"
        "mpi4py.rc.initialize = False\n"
        "assert not hasattr(mpi4py, 'futures_executor')\n"
        "print(MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.allreduce(5))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLAIT_", "OMPI_", "PMIX"))}
    env["PYTHONPATH"] = mpi4py_path()
    res = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["1", "5"]


@pytest.fixture(scope="module")
def plait_tcp_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], str]:
    out = tmp_path_factory.mktemp("plait-tcp") / "out"
    return _run_all([*PLAIT, "run", "-n", str(RANKS), "--transport", "tcp", "--mpi4py"], out)


def test_same_output_over_tcp(
    plait_outputs: dict[tuple[str, int], str], plait_tcp_outputs: dict[tuple[str, int], str]
) -> None:
    # Every script, every rank, with the ranks connected over TCP instead of shared memory.
    assert plait_tcp_outputs == plait_outputs
