"""plait.dask.run on a real Dask LocalCluster: 3 worker processes of 1 thread each, on loopback.

One cluster serves the module. Every collective is checked against numpy in
one run; then results order, two runs in a row and from two clients at once
(nothing left in the scheduler), a failing rank, a busy worker, a worker
named that does not exist, and (last: its worker comes back at a new address)
a worker killed while its rank runs.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

distributed = pytest.importorskip(
    "distributed", reason="plait.dask needs Dask's distributed: pip install 'plait[dask]'"
)

import cloudpickle  # noqa: E402 - ships with distributed

import plait  # noqa: E402
import plait.dask  # noqa: E402
from plait.dask._store import SECRET_DATASET  # noqa: E402
from plait.rendezvous.kv_store import poll_until  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

SIZE = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A LocalCluster of SIZE single-threaded worker processes; this module's functions by value."""
    # The workers need not import this test module to run its functions.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        with distributed.LocalCluster(
            n_workers=SIZE,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",  # None still serves /metrics on 8787, if free
        ) as cluster:
            yield cluster
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def client(cluster: Any) -> Iterator[Any]:
    with distributed.Client(cluster) as client:
        yield client


def no_plait_keys_left(cluster: Any) -> bool:
    """Whether no run's keys are left in the scheduler's metadata (the scheduler is in-process)."""
    return not any(
        isinstance(v, dict) and v.get("plait") for v in cluster.scheduler.task_metadata.values()
    )


def inputs(rank: int, size: int) -> dict[str, Any]:
    """Rank ``rank``'s inputs, the same on the workers and in the test."""
    rng = np.random.default_rng(2000 + rank)
    return {
        "f64": rng.standard_normal((4, 3)),
        "i32": rng.integers(-100, 100, size=7).astype(np.int32),
        "f32": rng.standard_normal(5).astype(np.float32),
        "rows": rng.standard_normal((2 * size, 3)),
        "parts": rng.integers(0, 1000, size=2 * size).astype(np.int64),
        "scatter": rng.standard_normal((size, 2)),
    }


def every_collective(comm: plait.Communicator) -> dict[str, Any]:
    """One call of each collective and of send/recv; what this rank got."""
    r, p = comm.rank, comm.size
    x = inputs(r, p)
    out: dict[str, Any] = {"rank": r, "size": p, "worker": distributed.get_worker().address}
    out["allreduce"] = comm.allreduce(x["f64"])
    out["reduce"] = comm.reduce(x["i32"], root=1, op=plait.MAX)
    b = x["f32"].copy()
    comm.broadcast(b, root=2)
    out["broadcast"] = b
    out["reduce_scatter"] = comm.reduce_scatter(x["rows"])
    out["allgather"] = comm.allgather(x["f32"])
    out["alltoall"] = comm.alltoall(x["parts"])
    out["gather"] = comm.gather(x["i32"], root=0)
    out["scatter"] = comm.scatter(x["scatter"], root=1)
    comm.barrier()
    if r == 0:
        for dst in range(1, p):
            comm.send(np.arange(4.0) * dst, dst, tag=7)
        out["recv"] = None
    else:
        out["recv"] = comm.recv(np.empty(4), 0, tag=7)
    return out


def test_every_collective_against_numpy(client: Any, cluster: Any) -> None:
    results = plait.dask.run(client, every_collective, timeout=20)
    xs = [inputs(r, SIZE) for r in range(SIZE)]
    assert [o["rank"] for o in results] == list(range(SIZE))
    assert [o["worker"] for o in results] == plait.dask.rank_order(client)
    for r, o in enumerate(results):
        assert o["size"] == SIZE
        np.testing.assert_array_equal(o["allreduce"], sum(x["f64"] for x in xs))
        if r == 1:
            np.testing.assert_array_equal(o["reduce"], np.max([x["i32"] for x in xs], axis=0))
        else:
            assert o["reduce"] is None
        np.testing.assert_array_equal(o["broadcast"], xs[2]["f32"])
        total = sum(x["rows"] for x in xs)
        np.testing.assert_array_equal(o["reduce_scatter"], total[2 * r : 2 * r + 2])
        np.testing.assert_array_equal(o["allgather"], np.stack([x["f32"] for x in xs]))
        np.testing.assert_array_equal(
            o["alltoall"], np.concatenate([x["parts"][2 * r : 2 * r + 2] for x in xs])
        )
        if r == 0:
            np.testing.assert_array_equal(o["gather"], np.stack([x["i32"] for x in xs]))
        else:
            assert o["gather"] is None
        np.testing.assert_array_equal(o["scatter"], xs[1]["scatter"][r : r + 1])
        if r:
            np.testing.assert_array_equal(o["recv"], np.arange(4.0) * r)
    assert no_plait_keys_left(cluster)


def where(comm: plait.Communicator, tag: str) -> tuple[str, int, str]:
    return tag, comm.rank, distributed.get_worker().address


def test_results_in_rank_order_and_workers_chosen(client: Any) -> None:
    order = plait.dask.rank_order(client)
    names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    assert [names[a] for a in order] == list(range(SIZE))  # LocalCluster's worker i is rank i
    assert plait.dask.run(client, where, "a") == [("a", r, order[r]) for r in range(SIZE)]
    chosen = [order[2], order[0]]
    assert plait.dask.run(client, where, tag="b", workers=chosen) == [
        ("b", 0, order[2]),
        ("b", 1, order[0]),
    ]
    with pytest.raises(ValueError, match="no worker of the cluster"):
        plait.dask.run(client, where, "c", workers=["tcp://127.0.0.1:1"])


def keywords_named_like_runs_own(
    comm: plait.Communicator, fn: str = "", client: str = ""
) -> tuple[str, str]:
    return fn, client


def test_keywords_named_client_or_fn_go_on_to_fn(client: Any) -> None:
    """run's client and fn are positional-only: keywords of those names are fn's. They
    raised "got multiple values for argument 'fn'"."""
    got = plait.dask.run(client, keywords_named_like_runs_own, fn="x", client="y")
    assert got == [("x", "y")] * SIZE


class AskedOnlyForWorkers:
    """A Client double for arguments refused before anything reaches the cluster: ``run`` may
    ask it which workers there are; any other use (a start lock, a task, the metadata that
    holds the secret) fails the test."""

    asynchronous = False

    def scheduler_info(self, n_workers: int = -1) -> dict[str, Any]:
        return {"workers": {f"tcp://127.0.0.1:{9000 + r}": {"name": r} for r in range(2)}}

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("plait.dask.run submitted a task before refusing its arguments")

    get_metadata = set_metadata = submit

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"plait.dask.run used client.{name} before refusing its arguments")


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"start_timeout": float("nan")}, ValueError, r"start_timeout: timeout must be positive"),
        ({"start_timeout": 0}, ValueError, r"start_timeout: timeout must be positive"),
        ({"timeout": -1}, ValueError, r"^plait\.dask\.run: timeout must be positive; got -1"),
        ({"timeout": float("nan")}, ValueError, r"timeout must be positive; got nan"),
        ({"timeout": "5"}, TypeError, r"timeout must be a number of seconds"),
        ({"transport": "bogus"}, ValueError, r"unknown transport 'bogus'; expected one of auto"),
        ({"transport": object()}, TypeError, r"transport must be one of .* got object"),
    ],
)
def test_bad_keywords_are_refused_before_anything_is_submitted(
    keywords: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        plait.dask.run(AskedOnlyForWorkers(), total, 1, **keywords)


def total(comm: plait.Communicator, n: int) -> float:
    return float(comm.allreduce(np.full(n, comm.rank + 1.0)).sum())


def test_two_runs_in_a_row_and_two_clients_at_once(client: Any, cluster: Any) -> None:
    want = [6.0 * 5] * SIZE
    assert plait.dask.run(client, total, 5) == want
    assert plait.dask.run(client, total, 5) == want
    got: dict[str, Any] = {}

    def from_another_client(name: str) -> None:
        try:
            with distributed.Client(cluster) as other:
                got[name] = plait.dask.run(other, total, 5, timeout=20)
        except BaseException as exc:
            got[name] = exc

    threads = [threading.Thread(target=from_another_client, args=(n,)) for n in "xy"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert got == {"x": want, "y": want}
    assert no_plait_keys_left(cluster)


class Records(logging.Handler):
    """Keeps the records of the loggers it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_two_runs_that_draw_the_secret_at_once_log_no_error(client: Any, cluster: Any) -> None:
    # Two runs from two clients on a cluster without a secret: both draw one. The publish
    # that lost the race made the scheduler (in this process) log a traceback at ERROR.
    # The workers keep the secret they took from an earlier test's run, if any; the
    # cluster's is put back at the end, for workers that start later.
    before = client.get_dataset(SECRET_DATASET, default=None)
    want = [6.0 * 2] * SIZE
    records = Records()
    loggers = [logging.getLogger(n) for n in ("distributed.publish", "distributed.core")]
    got: dict[str, Any] = {}
    both = threading.Barrier(2)

    def one(name: str) -> None:
        try:
            with distributed.Client(cluster) as other:
                both.wait(30)
                got[name] = plait.dask.run(other, total, 2, timeout=20)
        except BaseException as exc:
            got[name] = exc

    for logger in loggers:
        logger.addHandler(records)
    try:
        for _ in range(2):
            if SECRET_DATASET in client.list_datasets():
                client.unpublish_dataset(SECRET_DATASET)
            got.clear()
            threads = [threading.Thread(target=one, args=(n,)) for n in "xy"]
            for t in threads:
                t.start()
            for t in threads:
                t.join(50)
            assert got == {"x": want, "y": want}
            assert SECRET_DATASET in client.list_datasets()
    finally:
        for logger in loggers:
            logger.removeHandler(records)
        if before is not None:
            client.publish_dataset(before, name=SECRET_DATASET, override=True)
    errors = [f"{r.name}: {r.getMessage()}" for r in records.records if r.levelno >= logging.ERROR]
    assert not errors, errors


def executing(client: Any, address: str) -> set[str]:
    """The keys of the tasks running on a worker now."""
    got = client.run(
        lambda dask_worker: [str(ts.key) for ts in dask_worker.state.executing],
        workers=[address],
    )
    return set(got[address])


def test_two_runs_on_crossed_workers_both_start(cluster: Any, client: Any) -> None:
    # Run x takes workers (a, b), run y (b, a). x submits its rank 0, then waits until y's
    # rank 0 runs on b before it submits its rank 1. Were y free to submit while x starts,
    # each run would hold the worker the other waits for, and both would fail their start.
    a, b = plait.dask.rank_order(client)[:2]
    x_began = threading.Event()
    y_runs_on_b = threading.Event()
    got: dict[str, Any] = {}

    def submitting(c: Any, name: str) -> Any:
        submit = c.submit

        def watched(fn: Any, *args: Any, key: str, **kwargs: Any) -> Any:
            if name == "x" and key.endswith("-1"):
                y_runs_on_b.wait(5)  # y has its start locks' turn only after x has started
            future = submit(fn, *args, key=key, **kwargs)
            if name == "x":
                x_began.set()
            elif key.endswith("-0"):
                poll_until(lambda: key in executing(c, b), time.monotonic() + 5)
                y_runs_on_b.set()
            return future

        return watched

    def one_run(name: str, workers: list[str]) -> None:
        try:
            with distributed.Client(cluster) as c:
                if name == "y":
                    x_began.wait(10)
                c.submit = submitting(c, name)
                got[name] = plait.dask.run(c, total, 2, workers=workers, start_timeout=15)
        except BaseException as exc:
            got[name] = exc

    threads = [
        threading.Thread(target=one_run, args=("x", [a, b])),
        threading.Thread(target=one_run, args=("y", [b, a])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert got == {"x": [6.0, 6.0], "y": [6.0, 6.0]}
    assert no_plait_keys_left(cluster)


def fails_on_rank_1(comm: plait.Communicator) -> None:
    if comm.rank == 1:
        raise ValueError("rank 1 gives up")
    comm.allreduce(np.ones(3), timeout=30)  # the others wait for rank 1 here


def test_a_failing_rank_fails_the_others_within_seconds(client: Any) -> None:
    order = plait.dask.rank_order(client)
    start = time.monotonic()
    with pytest.raises(plait.dask.GangError, match="rank 1 of 3") as info:
        plait.dask.run(client, fails_on_rank_1)
    assert time.monotonic() - start < 10  # not the others' 30 s timeout
    err = info.value
    assert (err.rank, err.worker) == (1, order[1])
    assert isinstance(err.exception, ValueError)
    assert isinstance(err.__cause__, ValueError)
    assert "rank 1 gives up" in str(err)
    assert set(err.failures) == {0, 1, 2}
    assert all(isinstance(err.failures[r], plait.PeerLostError) for r in (0, 2))
    assert err.running == []
    assert plait.dask.run(client, total, 1) == [6.0] * SIZE  # the cluster is fine


def fails_to_start(
    client: Any, match: str, missing: dict[int, str], *, start_timeout: float
) -> None:
    """A run fails to start with StartTimeout soon after ``start_timeout``, naming ``missing``."""
    start = time.monotonic()
    with pytest.raises(plait.dask.StartTimeout, match=match) as info:
        plait.dask.run(client, total, 1, start_timeout=start_timeout)
    assert time.monotonic() - start < start_timeout + 3
    assert info.value.missing == missing


def test_a_busy_worker_fails_the_start_after_the_deadline(client: Any) -> None:
    order = plait.dask.rank_order(client)
    assert plait.dask.run(client, total, 1) == [6.0] * SIZE  # the ranks start quickly now
    release = distributed.Event(f"plait-test-release-{time.monotonic_ns()}", client=client)
    blocker = client.submit(
        lambda ev: ev.wait(50), release, workers=[order[2]], pure=False, allow_other_workers=False
    )
    try:
        fails_to_start(client, r"rank 2 on \S+ \(busy", {2: order[2]}, start_timeout=2.0)
    finally:
        release.set()
        blocker.result(timeout=20)
    assert plait.dask.run(client, total, 1) == [6.0] * SIZE


def test_a_worker_another_run_starts_on_fails_the_start_after_the_deadline(client: Any) -> None:
    order = plait.dask.rank_order(client)
    held = distributed.Lock(
        f"plait-dask-start-{order[1]}", scheduler_rpc=client.scheduler, loop=client.loop
    )
    assert held.acquire(timeout=5)
    try:
        fails_to_start(client, r"another plait\.dask\.run", {1: order[1]}, start_timeout=1.0)
    finally:
        held.release()
    assert plait.dask.run(client, total, 1) == [6.0] * SIZE  # its locks were given back


def test_the_example_runs(cluster: Any) -> None:
    # As a script, so that its functions travel by value (they are __main__'s), on this
    # module's cluster.
    script = Path(__file__).resolve().parents[2] / "examples" / "dask_allreduce.py"
    res = subprocess.run(
        [sys.executable, str(script), cluster.scheduler_address],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == SIZE
    assert all(line.endswith("mean [2. 2. 2. 2.]") for line in lines), res.stdout


def killed_on_rank_1(comm: plait.Communicator) -> None:
    comm.allreduce(np.ones(3), timeout=30)
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the worker process dies with its rank
    comm.allreduce(np.ones(3), timeout=30)  # the others are in this call when it dies


def test_a_worker_killed_mid_run_fails_the_run_naming_it(client: Any) -> None:
    order = plait.dask.rank_order(client)
    start = time.monotonic()
    with pytest.raises(plait.dask.GangError, match="rank 1 of 3") as info:
        plait.dask.run(client, killed_on_rank_1)
    assert time.monotonic() - start < 20  # not the others' 30 s timeout
    err = info.value
    assert (err.rank, err.worker) == (1, order[1])
    assert "left the Dask cluster" in str(err)
    assert set(err.failures) == {0, 1, 2}
    assert all(isinstance(err.failures[r], plait.PeerLostError) for r in (0, 2))
    assert err.running == []
    # The nanny starts the worker again, at a new address: the cluster runs the next job.
    client.wait_for_workers(SIZE, timeout=30)
    assert plait.dask.run(client, total, 1) == [6.0] * SIZE
