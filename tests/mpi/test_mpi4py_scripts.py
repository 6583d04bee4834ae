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


def test_is_initialized_is_false_until_init_where_rc_says_not_to_initialize() -> None:
    """Is_initialized was True whatever mpi4py.rc said; mpi4py's is False after
    ``rc.initialize = False`` until MPI.Init(), and a script may call Init behind it."""
    from plait.mpi import mpi4py_path

    later = (
        "import mpi4py\n"
        "mpi4py.rc.initialize = False\n"
        "from mpi4py import MPI\n"
        "said = [MPI.Is_initialized()]\n"
        "MPI.Init()\n"
        "print(said + [MPI.Is_initialized()], MPI.COMM_WORLD.allreduce(1))\n"
    )
    at_once = "from mpi4py import MPI\nprint(MPI.Is_initialized())\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLAIT_", "OMPI_", "PMIX"))}
    env["PYTHONPATH"] = mpi4py_path()
    said = []
    for check in (later, at_once):
        res = subprocess.run(
            [sys.executable, "-c", check], capture_output=True, text=True, timeout=60, env=env
        )
        assert res.returncode == 0, res.stderr
        said.append(res.stdout.strip())
    assert said == ["[False, True] 1", "True"]


PROGRAM = """
import sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
print(comm.Get_rank(), comm.allreduce(1), __name__, sys.argv, flush=True)
"""


@pytest.mark.parametrize("kind", ["script", "-m", "-c"])
def test_python_m_mpi4py_runs_a_script_a_module_or_a_command(kind: str, tmp_path: Path) -> None:
    """``python -m mpi4py prog.py`` under ``--mpi4py`` failed: the package had no
    ``__main__`` ("No module named mpi4py.__main__"). Each program runs as ``__main__`` with
    the ``sys.argv`` mpi4py gives it."""
    (tmp_path / "prog.py").write_text(PROGRAM)
    program = {"script": ["prog.py"], "-m": ["-m", "prog"], "-c": ["-c", PROGRAM]}[kind]
    res = subprocess.run(
        [*PLAIT, "run", "-n", "2", "--mpi4py", sys.executable, "-m", "mpi4py", *program, "x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    argv0 = {"script": "prog.py", "-m": str(tmp_path / "prog.py"), "-c": "-c"}[kind]
    lines = sorted(line for line in res.stdout.splitlines() if line[:1].isdigit())
    assert lines == [f"{r} 2 __main__ {[argv0, 'x']}" for r in range(2)]


def test_mpi4py_version_is_mpi4pys_labelled_as_plaits(tmp_path: Path) -> None:
    """``mpi4py.__version__`` raised AttributeError. It is the mpi4py release plait.mpi
    follows with a local label, which version parsers accept; ``python -m mpi4py --version``
    says it as mpi4py's does."""
    from plait.mpi import mpi4py_path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLAIT_", "OMPI_", "PMIX"))}
    env["PYTHONPATH"] = mpi4py_path()
    check = (
        "import mpi4py\n"
        "from packaging.version import Version\n"
        "v = Version(mpi4py.__version__)\n"
        "print(mpi4py.__version__, v.public, v.local, v >= Version('4.0'))\n"
    )
    said = []
    for command in (["-c", check], ["-m", "mpi4py", "--version"]):
        res = subprocess.run(
            [sys.executable, *command], capture_output=True, text=True, timeout=60, env=env
        )
        assert res.returncode == 0, res.stderr
        said.append(res.stdout.strip())
    assert said == ["4.1.0+plait 4.1.0 plait True", "mpi4py 4.1.0+plait"]


@pytest.fixture(scope="module")
def plait_tcp_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], str]:
    out = tmp_path_factory.mktemp("plait-tcp") / "out"
    return _run_all([*PLAIT, "run", "-n", str(RANKS), "--transport", "tcp", "--mpi4py"], out)


def test_same_output_over_tcp(
    plait_outputs: dict[tuple[str, int], str], plait_tcp_outputs: dict[tuple[str, int], str]
) -> None:
    # Every script, every rank, with the ranks connected over TCP instead of shared memory.
    assert plait_tcp_outputs == plait_outputs


def test_python_m_mpi4py_c_compiles_the_command_with_no_future_of_its_own() -> None:
    """``python -m mpi4py -c`` compiled the command inheriting the runner's own ``from
    __future__ import annotations``: its annotations came out as strings, where ``python
    -c``'s (and mpi4py's) are the objects."""
    from plait.mpi import mpi4py_path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLAIT_", "OMPI_", "PMIX"))}
    env["PYTHONPATH"] = mpi4py_path()
    command = "def f(x: int): pass\nprint(f.__annotations__['x'] is int)\n"
    res = subprocess.run(
        [sys.executable, "-m", "mpi4py", "-c", command],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"
