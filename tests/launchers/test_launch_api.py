"""``plait.launch``: the launcher behind ``plait run`` and ``plait bench``, called as a function."""

from __future__ import annotations

import io
import sys

import pytest

from plait.launch import TRANSPORTS, Job, launch, module_command

#: Prints the rank, the job's size and a variable the job adds: "0/2 y".
SHOW = (
    "import os; print(os.environ['PLAIT_RANK'] + '/' + os.environ['PLAIT_SIZE'], os.environ['X'])"
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"command": ()}, "needs a command"),
        ({"nproc": 0}, "nproc >= 1"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 9}, "node_rank < nnodes"),
        ({"nnodes": 2}, "needs a master_port"),
        ({"transport": "udp"}, "transport must be one of"),
        ({"master_port": 70000}, r"master_port must be in 0\.\.65535"),  # it served on 4464
        ({"master_port": -1}, r"master_port must be in 0\.\.65535"),
    ],
)
def test_a_job_that_cannot_run_is_refused(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"command": ("true",), **kwargs}
    with pytest.raises(ValueError, match=message):
        Job(**fields)  # type: ignore[arg-type]


def test_several_hosts_need_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLAIT_SECRET", raising=False)
    job = Job(("true",), nnodes=2, node_rank=1, master_port=9)
    with pytest.raises(ValueError, match="PLAIT_SECRET"):
        launch(job)


def test_module_command_runs_this_python_unbuffered() -> None:
    assert module_command("pkg.mod", "a") == (sys.executable, "-u", "-m", "pkg.mod", "a")
    assert TRANSPORTS[0] == "auto"


def test_ranks_get_their_identity_and_extra_environment() -> None:
    out, err = io.StringIO(), io.StringIO()
    job = Job((sys.executable, "-c", SHOW), nproc=2, env={"X": "y"}, tag_output=True)
    assert launch(job, stdout=out, stderr=err) == 0, err.getvalue()
    assert sorted(out.getvalue().splitlines()) == ["[0]: 0/2 y", "[1]: 1/2 y"]


def test_a_failure_is_named_with_the_label_and_every_status() -> None:
    out, err = io.StringIO(), io.StringIO()
    body = "import os, sys; sys.exit(4 if os.environ['PLAIT_RANK'] == '1' else 0)"
    job = Job((sys.executable, "-c", body), nproc=2, label="bench")
    assert launch(job, stdout=out, stderr=err) == 4
    lines = err.getvalue().splitlines()
    assert "bench: rank 1 exited with code 4" in lines
    assert "bench:   rank 0: exit 0" in lines
    assert "bench:   rank 1: exit 4   <- started the failure" in lines
