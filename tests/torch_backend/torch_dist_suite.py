"""PyTorch's own distributed test suite, run against the "plait" backend and against gloo.

torch ships the suite it holds its backends to,
``torch/testing/_internal/distributed/distributed_test.py``
(``DistributedTest._DistTestBase``). It is run per backend with ``BACKEND``,
``WORLD_SIZE``, ``TEMP_DIR`` and ``INIT_METHOD`` in the environment and a small
``TestDistBackend`` subclass that spawns the ranks (torch's own
``test/distributed/test_distributed_spawn.py``, which the torch wheel does not
ship; :func:`_suite_class` is its equivalent). This script runs it three ways:

``gloo``
    the reference: ``BACKEND=gloo``, gloo's own process groups.
``plait``
    ``BACKEND=plait``; every process group the suite asks gloo for by name
    (``new_group(backend="gloo")``) is made by plait too, so that no test
    passes on plait because gloo did its work.
``plait-as-gloo``
    ``BACKEND=gloo``, with every process group made by plait. Many tests name
    gloo outright (``skipIf(BACKEND != "gloo")``, ``require_backend_is_available
    ({"gloo"})``) and so skip under ``BACKEND=plait``; this run gives them to
    plait. By default it runs only the tests that the ``plait`` run skipped
    and gloo ran.

A test's result on plait is its ``plait`` result, or its ``plait-as-gloo``
result where the ``plait`` run skipped it. The script prints every test's
result per run, the tests whose results differ from gloo's and a summary::

    python tests/torch_backend/torch_dist_suite.py                 # all of it (~2.5 min, 2 cores)
    python tests/torch_backend/torch_dist_suite.py -k sparse -k coalesced
    python tests/torch_backend/torch_dist_suite.py --modes plait --reference out/gloo.json

Each run's results go to ``OUT/<mode>.json`` (and its full output to
``OUT/<mode>.log``); ``--reference`` reuses a saved gloo run. The exit status
is 0 when every test gloo passes also passes on plait, except the ones torch
reserves for gloo by name (:data:`GLOO_ONLY`). See docs/torch.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

#: The environment variable that marks the worker and its spawned ranks, and names the run.
MODE_ENV = "PLAIT_TORCH_SUITE_MODE"
MODES = ("gloo", "plait", "plait-as-gloo")
#: How the worker starts the ranks of a test: "fork" (the default) or "spawn" (torch's way,
#: which re-imports torch in every rank of every test: ~7 s a test instead of ~0.3 s).
START_ENV = "PLAIT_TORCH_SUITE_START"
#: Tests that cannot pass on any backend but gloo: they assert the name "gloo", or call
#: monitored_barrier, which torch implements for gloo only (see docs/torch.md).
GLOO_ONLY = frozenset(
    {
        "test_get_backend",
        "test_monitored_barrier_gloo",
        "test_monitored_barrier_gloo_rank_0_timeout",
        "test_monitored_barrier_gloo_subgroup",
    }
)
#: Per-test deadline of the spawned ranks (torch's default is 300 s; DDP tests have more).
DEFAULT_TEST_TIMEOUT = 120
_MARK = "@@suite "


# -- inside the worker and its ranks ------------------------------------------------------------
def _gloo_made_by_plait() -> None:
    """Make every process group asked of gloo a plait one (in this process).

    torch creates a group's backend in ``_new_process_group_helper``; a gloo
    request (``"gloo"``, or a device map whose every backend is gloo) reaches
    it as the plait backend instead, and the group is registered as "plait".
    """
    import torch.distributed.distributed_c10d as c10d

    original = c10d._new_process_group_helper
    if getattr(original, "_plait_suite", False):
        return

    def is_gloo(backend: Any) -> bool:
        text = str(backend).lower()
        if text == "gloo":
            return True
        pairs = [p.split(":", 1) for p in text.split(",") if ":" in p]
        return bool(pairs) and all(b.strip() == "gloo" for _, b in pairs)

    def helper(
        group_size: int, group_rank: int, ranks: Any, backend: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if is_gloo(backend):
            backend = c10d.Backend("plait")
        return original(group_size, group_rank, ranks, backend, *args, **kwargs)

    helper._plait_suite = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = helper


def _suite_class() -> type:
    """torch's ``TestDistBackendWithSpawn``: the suite's tests, each on freshly spawned ranks."""
    import torch
    from torch.testing._internal.common_distributed import DistTestCases

    mode = os.environ[MODE_ENV]
    if mode != "gloo":
        import plait.torch  # noqa: F401 - registers the "plait" backend

        _gloo_made_by_plait()
    if mode == "plait":
        # Say what the backend supports, as torch's test runner does for the backends it
        # knows (CPU DDP and sub-groups; "plugin" is the suite's set of third-party
        # backends), before the suite's skip decorators read it on import.
        for feature in ("plugin", "ddp", "subgroup"):
            DistTestCases.backend_feature[feature].add("plait")
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc,name-defined]
        def setUp(self) -> None:
            super().setUp()
            if os.environ.get(START_ENV) == "fork":
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    TestDistBackendWithSpawn.__module__ = __name__
    return TestDistBackendWithSpawn


class _Recorder(unittest.TestResult):
    """Prints one marked line per finished test: name, outcome, seconds, first line of why."""

    def __init__(self, out: Callable[[dict[str, Any]], None]) -> None:
        super().__init__()
        self._out = out
        self._start = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._start = time.monotonic()

    def _record(self, test: unittest.TestCase, outcome: str, why: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        self._out(
            {
                "test": name,
                "outcome": outcome,
                "seconds": round(time.monotonic() - self._start, 2),
                "why": _why(why),
            }
        )

    def addSuccess(self, test: unittest.TestCase) -> None:
        self._record(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._record(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self._record(test, "fail", self._exc_info_to_string(err, test))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self._record(test, "skip", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._record(test, "pass")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self._record(test, "fail", "unexpected success")


def _why(text: str) -> str:
    """The most telling line of a failure: the last exception line of the ranks', else the last."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Timeout)\b", ln)]
    picked = errors[-1] if errors else (lines[-1] if lines else "")
    return picked[:300]


def _worker(names: Sequence[str] | None, patterns: Sequence[str]) -> int:
    """Run the selected tests of the suite class in this process, one marked line each."""
    cls = globals()["TestDistBackendWithSpawn"]
    loader = unittest.TestLoader()
    wanted = set(names) if names is not None else None
    selected = [
        n
        for n in loader.getTestCaseNames(cls)
        if (wanted is None or n in wanted) and (not patterns or any(p in n for p in patterns))
    ]

    def out(row: dict[str, Any]) -> None:
        print(_MARK + json.dumps(row), flush=True)

    result = _Recorder(out)
    for name in selected:
        cls(name).run(result)
    return 0


if os.environ.get(MODE_ENV):  # the worker, and the ranks it spawns (which re-import this file)
    TestDistBackendWithSpawn = _suite_class()


# -- the driver ----------------------------------------------------------------------------------
def list_tests() -> list[str]:
    """The suite's test names, read from torch's file (no torch import, no ranks)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise SystemExit("torch is not installed")
    path = Path(spec.origin).parent / "testing/_internal/distributed/distributed_test.py"
    return sorted(set(re.findall(r"^        def (test_\w+)\(self", path.read_text(), re.M)))


def run_mode(
    mode: str,
    out_dir: Path,
    *,
    world_size: int,
    patterns: Sequence[str],
    names: Sequence[str] | None,
    test_timeout: int,
    start: str,
) -> dict[str, dict[str, Any]]:
    """Run the suite one way in a worker process; its results by test name."""
    rows: dict[str, dict[str, Any]] = {}
    log = out_dir / f"{mode}.log"
    count = len(names) if names is not None else len(list_tests())
    deadline = time.monotonic() + 120 + count * (test_timeout + 30)
    with tempfile.TemporaryDirectory(prefix="plait-torch-suite-") as temp:
        env = {
            **os.environ,
            MODE_ENV: mode,
            START_ENV: start,
            "BACKEND": "plait" if mode == "plait" else "gloo",
            "WORLD_SIZE": str(world_size),
            "TEMP_DIR": temp,
            "INIT_METHOD": "env://",
            "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(test_timeout),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
        for p in patterns:
            cmd += ["-k", p]
        if names is not None:
            cmd += ["--tests", ",".join(names)]
        started = time.monotonic()
        with (
            log.open("w") as log_file,
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            ) as proc,
        ):
            assert proc.stdout is not None
            for line in proc.stdout:
                log_file.write(line)
                if line.startswith(_MARK):
                    row = json.loads(line[len(_MARK) :])
                    rows[row["test"]] = row
                    why = f"  {row['why']}" if row["outcome"] != "pass" else ""
                    print(
                        f"[{mode}] {row['outcome']:4} {row['seconds']:6.1f}s {row['test']}{why}",
                        flush=True,
                    )
                if time.monotonic() > deadline:
                    proc.kill()
                    print(f"[{mode}] overran its deadline; stopped", flush=True)
                    break
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        elapsed = time.monotonic() - started
    (out_dir / f"{mode}.json").write_text(
        json.dumps({"mode": mode, "seconds": round(elapsed, 1), "tests": rows}, indent=1)
    )
    counts = _counts(rows.values())
    print(f"[{mode}] {counts} in {elapsed:.0f} s; output in {log}", flush=True)
    return rows


def _counts(rows: Iterable[dict[str, Any]]) -> str:
    outcomes = [r["outcome"] for r in rows]
    return ", ".join(f"{outcomes.count(o)} {o}" for o in ("pass", "fail", "skip"))


def combine(
    plait: dict[str, dict[str, Any]], as_gloo: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Each test's result on plait: the plait run's, or plait-as-gloo's where plait skipped."""
    out = dict(plait)
    for name, row in as_gloo.items():
        if name not in out or out[name]["outcome"] == "skip":
            out[name] = {**row, "via": "plait-as-gloo"}
    return out


def compare(gloo: dict[str, dict[str, Any]], plait: dict[str, dict[str, Any]]) -> int:
    """Print the differences and the table; the number of unexpected differences."""
    names = sorted(set(gloo) & set(plait))
    g_pass = [n for n in names if gloo[n]["outcome"] == "pass"]
    both = [n for n in g_pass if plait[n]["outcome"] == "pass"]
    lost = [n for n in g_pass if plait[n]["outcome"] != "pass"]
    extra = [n for n in names if gloo[n]["outcome"] == "skip" and plait[n]["outcome"] == "pass"]
    print("\n== tests gloo passes and plait does not")
    for n in lost:
        tag = " (reserved for gloo)" if n in GLOO_ONLY else ""
        print(f"  {plait[n]['outcome']:4} {n}{tag}: {plait[n]['why']}")
    print("== tests gloo skips and plait passes")
    for n in extra:
        print(f"  pass {n} (gloo: {gloo[n]['why']})")
    print("\n| | pass | fail | skip |")
    print("|---|---|---|---|")
    for label, rows in (("gloo", gloo), ("plait", plait)):
        sel = [rows[n]["outcome"] for n in names]
        print(f"| {label} | {sel.count('pass')} | {sel.count('fail')} | {sel.count('skip')} |")
    print(f"\nof the {len(g_pass)} tests gloo passes, plait passes {len(both)}")
    unexpected = [n for n in lost if n not in GLOO_ONLY]
    return len(unexpected)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="patterns", action="append", default=[], metavar="SUBSTRING")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: %(default)s")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="folder for results and logs")
    parser.add_argument("--reference", type=Path, help="a saved gloo.json to compare with")
    parser.add_argument("--test-timeout", type=int, default=DEFAULT_TEST_TIMEOUT)
    parser.add_argument(
        "--start",
        choices=("spawn", "fork"),
        default="fork",
        help="how each test's ranks start: fork (the default: ~25x faster) or spawn (torch's way)",
    )
    parser.add_argument("--all-as-gloo", action="store_true", help="plait-as-gloo runs every test")
    parser.add_argument("--list", action="store_true", help="list the suite's tests and exit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tests", default=None, help="comma-separated test names (exact)")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.tests.split(",") if args.tests else None, args.patterns)
    if args.list:
        print("\n".join(list_tests()))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"unknown modes {bad}; choose from {MODES}")
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="plait-torch-suite-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    common = {
        "world_size": args.world_size,
        "patterns": args.patterns,
        "test_timeout": args.test_timeout,
        "start": args.start,
    }
    results: dict[str, dict[str, dict[str, Any]]] = {}
    if args.reference is not None:
        saved = json.loads(args.reference.read_text())["tests"]
        results["gloo"] = {
            n: r
            for n, r in saved.items()
            if (not args.patterns or any(p in n for p in args.patterns))
            and (not args.tests or n in args.tests.split(","))
        }
    chosen = [n.strip() for n in args.tests.split(",") if n.strip()] if args.tests else None
    started = time.monotonic()
    for mode in modes:
        if mode == "gloo" and "gloo" in results:
            continue
        names = chosen
        if mode == "plait-as-gloo" and not args.all_as_gloo and "plait" in results:
            ran_on_gloo = results.get("gloo")
            names = [
                n
                for n, r in results["plait"].items()
                if r["outcome"] == "skip"
                and (ran_on_gloo is None or ran_on_gloo.get(n, {}).get("outcome") != "skip")
            ]
            if not names:
                continue
        results[mode] = run_mode(mode, out_dir, names=names, **common)  # type: ignore[arg-type]
    print(f"\nall runs: {time.monotonic() - started:.0f} s; results in {out_dir}")
    if not ({"plait", "plait-as-gloo"} & set(results)):
        return 0
    plait = combine(results.get("plait", {}), results.get("plait-as-gloo", {}))
    (out_dir / "plait-combined.json").write_text(json.dumps({"tests": plait}, indent=1))
    if "gloo" not in results:  # nothing to compare with: every test that ran must pass
        failed = sorted(n for n, r in plait.items() if r["outcome"] == "fail")
        print(f"plait: {_counts(plait.values())}")
        for n in failed:
            print(f"  fail {n}: {plait[n]['why']}")
        return 1 if failed else 0
    return 1 if compare(results["gloo"], plait) else 0


if __name__ == "__main__":
    sys.exit(main())
