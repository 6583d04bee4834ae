"""``plait bench`` when its ranks cannot start or fail: one line that says why, no traceback."""

from __future__ import annotations

import io
import json
import os
import re
import resource
import subprocess
from pathlib import Path

from bench_helpers import PLAIT, bench, series

from plait.bench import runner


def test_a_launcher_that_cannot_start_the_ranks_says_so_in_one_line(tmp_path: Path) -> None:
    # A traceback ending in plait.launch.job.StartError, where plait run says one line.
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    res = subprocess.run(
        [*PLAIT, "bench", "-n", "30", "-s", "8", "--no-progress", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        preexec_fn=few_descriptors,
    )
    assert res.returncode == 1, res.stderr  # as plait run exits for it
    assert "Traceback" not in res.stderr
    why = "the launcher needs about"
    assert f"plait bench: plait: failed: {why}" in res.stderr
    assert f"# error: {why}" in res.stdout
    assert "raise it (ulimit -n) or start fewer ranks" in res.stdout
    (s,) = json.loads(out.read_text())["series"]
    assert s["error"].startswith(why)
    assert s["rows"] == []


def test_ranks_that_fail_before_reporting_say_why_without_progress(tmp_path: Path) -> None:
    # The error line said only "the ranks exited with code 1 and reported nothing". (An
    # interface list of no interface here passes plait bench's check of its form, and fails
    # in the ranks' plait.init.)
    env = {"PLAIT_SOCKET_IFNAME": "=nosuchif0"}
    res, doc = bench("-n 2 -s 64 -t tcp --no-progress", tmp_path, env)
    assert res.returncode == 1
    why = r"rank [01] failed with ValueError: no network interface with an address matches"
    error = f"the ranks exited with code 1 and reported nothing; {why}"
    assert doc is not None
    assert re.match(error, series(doc, "plait-tcp")["error"])
    assert re.search(f"^# error: {error}", res.stdout, re.MULTILINE)


def test_the_timeout_bounds_the_calls_not_the_rendezvous(tmp_path: Path) -> None:
    # --timeout 1e-6 was PLAIT_TIMEOUT, which plait.init read too: every rank failed in
    # the rendezvous (a StoreTimeout) and no call was made. Four ranks on this machine's
    # cores cannot all arrive together at 400 calls: some call waits, and times out (at 20,
    # all of them once arrived in time, and the run succeeded).
    argv = ["-n", "4", "-s", "4K", "--no-progress", "--iters", "400", "--timeout", "1e-6"]
    res, doc = bench(argv, tmp_path, fast=False)
    assert res.returncode == 1
    assert "StoreTimeout" not in res.stderr
    assert doc is not None
    error = series(doc, "plait")["error"]
    assert "allreduce (" in error, error  # the call it timed, which timed out
    assert "plait.init" not in error


def test_the_timeout_is_the_communicators_default_not_each_calls_own(tmp_path: Path) -> None:
    # A call given its own timeout= leaves plait's short path: the bench would time that.
    from plait.bench import worker
    from plait.bench.loop import SweepSpec

    spec = SweepSpec("allreduce", "float32", "sum", 0, False, [(64, 16)], ["auto"], {}, "")
    spec.options = {"timeout": 42.0}
    backend, _, close = worker._make(spec)  # one rank: no launcher around
    try:
        assert backend.comm.timeout == 42.0
    finally:
        close()


def test_the_launchers_own_lines_name_the_cause() -> None:
    sink = io.StringIO()
    said = runner._Said(sink, "plait run")
    said.write("[1]: Traceback (most recent call last):\n[1]: ValueError: x\nplait run: rank 1 ")
    said.write("exited with code 1 (ValueError)\nplait run:   rank 1: exit 1\n")
    assert said.cause() == "rank 1 exited with code 1 (ValueError)"
    said.write("plait run: rank 1 failed with ValueError: x\n")
    assert said.cause() == "rank 1 failed with ValueError: x"
    assert sink.getvalue().count("\n") == 5  # every line went on to the bench's stderr
    assert runner._Said(io.StringIO(), "plait run").cause() is None
