"""Shared set-up: make ``tests/`` importable for the helpers module; hermetic settings; markers.

The tests must not depend on this machine's tuning: a profile written by
``plait tune`` (``~/.config/plait/profile.json``) or a PLAIT_ALGO in the
environment would change what ``algorithm="auto"`` picks. Both are cleared
for the whole session (ranks started by the tests inherit that); tests that
want them set their own.
"""

import os
import sys
from pathlib import Path

import pytest

from plait.selection import select as _select

sys.path.insert(0, str(Path(__file__).parent))

os.environ["PLAIT_PROFILE"] = str(Path(__file__).parent / "no-such-profile.json")
os.environ.pop("PLAIT_ALGO", None)
os.environ["PLAIT_RULES"] = os.devnull  # an empty rules file, not ~/.config/plait/rules.toml


# In-process ranks choose as on a host with a core for every rank, whatever this machine has
# (the oversubscribed rules would otherwise depend on it); tests that want fewer cores patch
# select._cores themselves. Ranks in child processes see the real count.
_select._cores = lambda: 1024


# Folders whose every test starts processes or needs an extra; the marker goes on each test
# (see pyproject.toml for the markers, and the README for the quick loop that leaves them out).
# Modules elsewhere that start processes mark themselves with ``pytestmark``.
_FOLDER_MARKERS = {
    "multiprocess": ("multiprocess",),
    "launchers": ("multiprocess",),
    "multihost": ("multiprocess", "multihost"),
    "torch_backend": ("torch",),
}

# Single modules elsewhere whose every test starts processes (ranks, servers, launchers).
_MODULE_MARKERS = {
    "test_torch_jobs.py": ("multiprocess",),
    "test_torch_uneven.py": ("multiprocess",),
    "test_bench_cli.py": ("multiprocess",),
    "test_bench_compare.py": ("multiprocess",),
    "test_redis_store.py": ("multiprocess",),
    "test_compression_convergence.py": ("slow",),
    # TCP's wire-level and hostile-setup cases; the quick loop keeps its conformance and test_tcp.py
    "test_tcp_protocol.py": ("slow",),
    "test_tcp_bootstrap.py": ("slow",),
}


# Modules whose tests share a costly module fixture (emulated hosts, a Ray or Dask cluster,
# mpirun, a trained model): with pytest-xdist (``-n``) each runs on one worker, so the fixture
# is made once, not once per worker.
_ONE_WORKER = {
    "test_multihost.py",
    "test_sim_validate.py",
    "test_ray_groups.py",
    "test_ray_group_lifecycle.py",
    "test_dask_run.py",
    "test_dask_threads.py",
    "test_mpi4py_scripts.py",
    "test_compression_convergence.py",
    "test_compression_docs.py",
    "test_overlap_summary.py",
}
# Of those, modules that run on one worker together: each starts a Ray cluster, and two of
# them side by side on two cores made actors start so slowly that calls timed by their joins
# ran out.
_SHARED_WORKER = {"test_ray_groups.py": "ray", "test_ray_group_lifecycle.py": "ray"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        try:
            folder = item.path.relative_to(here).parts[0]
        except ValueError:
            continue
        for name in (*_FOLDER_MARKERS.get(folder, ()), *_MODULE_MARKERS.get(item.path.name, ())):
            item.add_marker(name)
        if item.path.name in _ONE_WORKER:
            group = _SHARED_WORKER.get(item.path.name, item.path.stem)
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def no_stall_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No stall probes in this test's calls run in this process: a call that waits a second
    sends them (plait.runtime.stall), and the transport counts their bytes, so a rank's thread
    starved that long on a busy machine changed counts that a test holds exact."""
    from plait.runtime import stall, waits

    monkeypatch.setattr(stall, "PROBE_SECONDS", 600.0)
    monkeypatch.setattr(waits, "PROBE_SECONDS", 600.0)
