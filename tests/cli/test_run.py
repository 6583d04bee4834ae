"""``plait run``: identity in the environment, output tagging, failure and Ctrl-C handling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PLAIT = [sys.executable, "-m", "plait"]

pytestmark = pytest.mark.multiprocess  # every test starts the plait command


def run(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PLAIT, *args], capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload]


def script(tmp_path: Path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_ranks_get_their_identity(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        """
        import os, sys
        keys = ["PLAIT_RANK", "PLAIT_SIZE", "PLAIT_LOCAL_RANK", "PLAIT_LOCAL_SIZE",
                "PLAIT_NODE_RANK"]
        print(" ".join(os.environ[k] for k in keys), sys.argv[1:], os.environ["PLAIT_STORE"][:6])
    """,
    )
    res = run(["run", "-n", "3", "--tag-output", s, "a", "--flag"])
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert lines == [f"[{r}]: {r} 3 {r} 3 0 ['a', '--flag'] tcp://" for r in range(3)]


def test_module_mode(tmp_path: Path) -> None:
    (tmp_path / "mymod.py").write_text("import os\nprint('hello from', os.environ['PLAIT_RANK'])\n")
    res = run(
        ["run", "-n", "2", "--tag-output", "-m", "mymod"],  # tagged: lines never interleave
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0]: hello from 0", "[1]: hello from 1"]


def test_failing_rank_stops_the_others(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["PLAIT_RANK"] == "2":
            sys.exit(3)
        # Behaviour under test, not synchronisation: a rank that never ends on its own,
        # so the job would hang if the launcher did not stop it.
        time.sleep(60)
    """,
    )
    start = time.monotonic()
    res = run(["run", "-n", "4", s])
    assert res.returncode == 3
    assert "rank 2 exited with code 3" in res.stderr
    assert time.monotonic() - start < 30


def test_rank_killed_by_signal(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        """
        import os, signal, time
        if os.environ["PLAIT_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # behaviour under test: a rank the launcher must stop, not a wait
    """,
    )
    res = run(["run", "-n", "2", s])
    assert res.returncode == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL" in res.stderr


def test_ctrl_c_stops_everything(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        """
        import os, time
        print(os.getpid(), flush=True)  # the test reads this line: the rank is up
        time.sleep(60)  # behaviour under test: a rank only Ctrl-C ends, not a wait
    """,
    )
    proc = subprocess.Popen(
        [*PLAIT, "run", "-n", "3", s], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    pids = [int(proc.stdout.readline()) for _ in range(3)]  # every rank is up
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT
    assert "received SIGINT" in err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bad_arguments() -> None:
    res = run(["run", "-n", "0", "x.py"])
    assert res.returncode != 0
    assert "-n must be a number of ranks >= 1, not 0" in res.stderr
    res = run(["run", "-n", "2", "--nnodes", "2", "x.py"])
    assert "--master-port" in res.stderr
    for bad in ("-5", "0", "nan"):  # every rank started, then failed in plait.init (0: none)
        res = run(["run", "-n", "2", "--timeout", bad, "x.py"])
        assert res.returncode == 2, res.stderr
        assert "--timeout must be a number of seconds > 0" in res.stderr


def test_algorithms_listing() -> None:
    res = run(["algorithms", "allreduce"])
    assert res.returncode == 0
    assert "ring" in res.stdout
    assert "commutative ops only" in res.stdout


def test_script_options_that_prefix_launcher_options_pass_through(tmp_path: Path) -> None:
    s = script(tmp_path, "import sys\nprint(sys.argv[1:])\n")
    res = run(["run", "-n", "1", s, "--n", "3", "--time", "x", "--nproc", "2"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['--n', '3', '--time', 'x', '--nproc', '2']"


def test_a_master_port_in_use_is_said_in_one_line(tmp_path: Path) -> None:
    """It printed the whole traceback of the store server's RendezvousError."""
    import socket

    script = tmp_path / "r.py"
    script.write_text("import plait\nplait.init()\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run(
            ["run", "-n", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
             str(script)]
        )  # fmt: skip
    assert res.returncode == 1
    assert res.stderr.strip() == (
        f"plait run: store server cannot listen on 127.0.0.1:{port}: [Errno 98] Address "
        "already in use"
    )


def test_ranks_beyond_the_descriptor_limit_are_said_in_one_line(tmp_path: Path) -> None:
    """A launcher out of descriptors printed subprocess's traceback of EMFILE; where the store
    ran out of them instead, the ranks waited out their init timeout (300 s)."""
    import resource

    job = script(tmp_path, "import time\ntime.sleep(60)\n")

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    for n in ("100", "20"):
        t0 = time.monotonic()
        res = run(["run", "-n", n, job], preexec_fn=few_descriptors)
        assert res.returncode == 1, res.stderr
        assert time.monotonic() - t0 < 30  # no rank was started
        assert "Traceback" not in res.stderr
        assert res.stderr.strip() == (
            f"plait run: the launcher needs about {32 + 3 * int(n)} file descriptors for {n} "
            "ranks here (two pipes for each rank's output, and the store's connections), but "
            "its limit is 64: raise it (ulimit -n) or start fewer ranks"
        )


def test_a_soft_descriptor_limit_too_low_for_the_job_is_raised(tmp_path: Path) -> None:
    """With 32 descriptors (the hard limit higher), 8 ranks' store ran out of them and the
    job waited out its ranks' init timeout."""
    import resource

    job = script(
        tmp_path, "import plait\nwith plait.init(timeout=60) as comm:\n    comm.barrier()\n"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 200:
        pytest.skip(f"the hard limit on descriptors here is {hard}")

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, hard))

    res = run(["run", "-n", "8", job], preexec_fn=few_descriptors)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("PLAIT_JOB_ID", "a/b", "PLAIT_JOB_ID='a/b' cannot name the job: expected 1 to 64 of"),
        ("PLAIT_STORE_MAX_VALUE", "abc", "PLAIT_STORE_MAX_VALUE='abc' is not a size in bytes"),
        # Each of these failed in every rank, with a traceback and exit 1.
        ("PLAIT_TIMEOUT", "abc", "PLAIT_TIMEOUT='abc': timeout must be a number of seconds"),
        ("PLAIT_TRANSPORT", "bogus", "PLAIT_TRANSPORT='bogus' is not a transport; expected"),
        ("PLAIT_STALL_TIMEOUT", "-3", "PLAIT_STALL_TIMEOUT must be a number of seconds >= 0"),
        ("PLAIT_ALGO", "allreduce:nope", "PLAIT_ALGO: 'allreduce:nope': unknown algorithm 'nope'"),
        ("PLAIT_BIND", "maybe", "PLAIT_BIND='maybe' is not a switch"),
    ],
)
def test_settings_the_launcher_reads_are_checked_before_any_rank(
    name: str, value: str, said: str
) -> None:
    """A bad PLAIT_STORE_MAX_VALUE was the launcher's traceback; a bad PLAIT_JOB_ID the same
    error from every rank's transport, which did not name it."""
    job = ["run", "-n", "2", sys.executable, "-c", "print('started')"]
    res = run(job, env={**os.environ, name: value})
    assert res.returncode == 2, res.stderr
    assert "started" not in res.stdout
    assert "Traceback" not in res.stderr
    assert f"plait run: error: {said}" in res.stderr
