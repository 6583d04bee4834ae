"""The "plait" torch.distributed backend inside one process: registration, the
checks at the torch edge, work handles, the store adapter and env:// under
``plait run``. Multi-process jobs are in ``test_torch_jobs.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed; the plait backend needs it (pip install 'plait[torch]')",
)
import torch.distributed as dist  # noqa: E402 - after the skip

import plait  # noqa: E402
import plait.torch  # noqa: E402
from plait.rendezvous.store import StoreTimeout  # noqa: E402
from plait.rendezvous.tcp_store import TCPStoreServer  # noqa: E402
from plait.testing import memory_communicators  # noqa: E402
from plait.torch import _work  # noqa: E402
from plait.torch._convert import plait_op, reshaped_out  # noqa: E402
from plait.torch._work import Lanes, PlaitWork, Reworded, globally_named, timed_out  # noqa: E402

R = dist.ReduceOp
C10D = torch._C._distributed_c10d


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


# -- import and registration -----------------------------------------------------------------
def test_import_plait_does_not_import_torch() -> None:
    res = run_python("import sys, plait; assert 'torch' not in sys.modules, 'torch imported'")
    assert res.returncode == 0, res.stderr


def test_without_torch_the_error_says_how_to_install() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import plait\n"
        "try:\n    import plait.torch\nexcept ImportError as exc:\n    print(exc)\n"
    )
    res = run_python(code)
    assert res.returncode == 0, res.stderr
    assert "pip install 'plait[torch]'" in res.stdout


def test_backend_is_registered_for_cpu_and_cuda() -> None:
    assert "plait" in dist.Backend.backend_list
    assert dist.Backend.PLAIT == "plait"
    assert dist.Backend.backend_capability["plait"] == ["cpu", "cuda"]  # CUDA: host copies
    assert dist.Backend.default_device_backend_map["cuda"] != "plait"  # nccl stays the default
    assert dist.Backend._plugins["PLAIT"].extended_api
    plait.torch.register()  # idempotent
    assert dist.Backend.backend_list.count("plait") == 1


def test_every_torch_op_but_premul_sum_maps_to_plait() -> None:
    names = {k.name for k in plait.torch.OPS}
    expected = {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"}
    assert names == expected
    assert plait_op(R.AVG, "x") is plait.AVG
    opts = dist.AllreduceOptions()
    opts.reduceOp = R.BXOR
    assert plait_op(opts.reduceOp, "x") is plait.BXOR
    premul = torch._C._distributed_c10d._make_nccl_premul_sum(2.0)
    with pytest.raises(plait.UnsupportedError, match="PREMUL_SUM"):
        plait_op(premul, "all_reduce")


# -- one rank, in this process ------------------------------------------------------------------
@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    """A one-rank default group on the plait backend (validation happens before any message)."""
    dist.init_process_group("plait", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_one_rank_group(world: dist.ProcessGroup) -> None:
    assert isinstance(world, plait.torch.ProcessGroupPlait)
    assert isinstance(world.communicator, plait.Communicator)
    assert dist.get_backend() == "plait"
    assert world.name() == "plait"
    t = torch.arange(6.0).reshape(2, 3)
    dist.all_reduce(t, op=R.MAX)
    assert t.tolist() == [[0, 1, 2], [3, 4, 5]]
    work = dist.all_reduce(t, async_op=True)
    assert isinstance(work, plait.torch.PlaitWork)
    assert isinstance(work, dist.Work)
    assert work.wait() is True
    assert work.get_future().wait()[0] is t


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: dist.all_reduce(torch.ones(2, device="meta")), ("meta", "no data")),
        (
            lambda: dist.broadcast(
                torch.sparse_coo_tensor([[0]], [1.0], (2,), check_invariants=True), 0
            ),
            ("sparse", "to_dense"),
        ),
        (
            lambda: dist.all_reduce(
                torch.ones(2), op=torch._C._distributed_c10d._make_nccl_premul_sum(2.0)
            ),
            ("PREMUL_SUM",),
        ),
        (lambda: dist.all_reduce(torch.zeros(1).expand(3)), ("overlapping", "clone")),
    ],
    ids=["meta device", "sparse", "premul_sum", "expanded output"],
)
def test_unsupported_calls_say_what_is_wrong(
    world: dist.ProcessGroup, call: object, words: tuple[str, ...]
) -> None:
    with pytest.raises(plait.UnsupportedError) as info:
        call()  # type: ignore[operator]
    for word in words:
        assert word in str(info.value)


def test_bad_arguments_are_plain_errors(world: dist.ProcessGroup) -> None:
    with pytest.raises(TypeError, match="AVG"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=R.AVG)
    with pytest.raises(ValueError, match="tensor_list has 2 tensors; expected world size 1"):
        dist.all_gather([torch.empty(2), torch.empty(2)], torch.ones(2))
    with pytest.raises(ValueError, match=r"tensor_list\[0\] has 3 elements; expected 2"):
        dist.all_gather([torch.empty(3)], torch.ones(2))  # this rank's own slot
    with pytest.raises(ValueError, match=r"input_list\[0\] has 3 elements and the output 2"):
        dist.reduce_scatter(torch.empty(2), [torch.ones(3)])
    with pytest.raises(ValueError, match="input_split_sizes"):
        dist.all_to_all_single(torch.empty(3), torch.ones(3), [3], [2])
    with pytest.raises(ValueError, match="elements"):
        dist.all_gather_single(torch.empty(3), torch.ones(2))
    with pytest.raises(ValueError, match="another rank"):
        dist.isend(torch.ones(1), dst=0)
    with pytest.raises(TypeError, match="pg_options"):
        dist.new_group(backend="plait", pg_options=object())


def test_communicator_of_a_plait_group(world: dist.ProcessGroup) -> None:
    """plait's own calls (the object collectives) on the group's communicator."""
    comm = plait.torch.communicator()
    assert comm is world.communicator
    assert plait.torch.communicator(world) is comm
    assert comm.allgather_object({"a": np.arange(3)})[0]["a"].tolist() == [0, 1, 2]
    empty = torch.empty(2, 0).t()  # no memory to overlap, though numpy gives it zero strides
    dist.all_to_all_single(empty, torch.empty(0, 2), [0], [0])


def test_communicator_of_another_backend_is_refused() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match="'plait' backend"):
            plait.torch.communicator()
    finally:
        dist.destroy_process_group()


def test_bfloat16_without_ml_dtypes_says_how_to_install(
    world: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with pytest.raises(TypeError, match=r"plait\[bfloat16\]"):
        dist.all_reduce(torch.ones(2, dtype=torch.bfloat16))


def test_strided_and_reshaped_outputs(world: dist.ProcessGroup) -> None:
    t = torch.arange(12.0).reshape(3, 4)
    view = t.t()  # not contiguous
    dist.all_reduce(view)
    assert torch.equal(t, torch.arange(12.0).reshape(3, 4))
    out = torch.empty(4, 3).t()  # a strided (3, 4) output, filled through a scratch copy
    dist.all_gather_single(out, torch.arange(12.0).reshape(3, 4))
    assert torch.equal(out, torch.arange(12.0).reshape(3, 4))
    a = np.empty((3, 4)).T
    target, finish = reshaped_out(a, (1, 12))
    target[...] = np.arange(12).reshape(1, 12)
    finish()
    assert np.array_equal(a, np.arange(12).reshape(4, 3))


# -- work handles --------------------------------------------------------------------------------
def test_work_over_a_lane_completes_future_and_raises_plaits_error() -> None:
    lane = Lanes("test-lane")
    release = threading.Event()
    try:
        task = lane.submit(0, "slow", lambda: release.wait(30))
        work = PlaitWork("rank 0: test", [task], ["out"], timeout=30)
        future = work.get_future()
        assert not work.is_completed()
        with pytest.raises(plait.CommTimeout, match=r"within 0\.05 s"):
            work.wait(timedelta(seconds=0.05))  # the call goes on
        assert not future.done()
        release.set()
        assert work.wait() is True
        assert future.wait() == ["out"]
        assert work.is_success()
        assert work.result() == ["out"]

        def fail() -> None:
            raise plait.PeerLostError("rank 1 is gone")

        bad = PlaitWork("rank 0: bad", [lane.submit(0, "fail", fail)], [], timeout=30)
        with pytest.raises(plait.PeerLostError, match="rank 1 is gone"):
            bad.wait()
        with pytest.raises(plait.PeerLostError):
            bad.get_future().wait()
        assert isinstance(bad.exception(), plait.PeerLostError)
        assert not bad.is_success()
    finally:
        release.set()
        lane.stop(10)


def test_ctrl_c_in_a_works_wait_is_a_keyboard_interrupt() -> None:
    """gloo's wait lets Ctrl-C by; plait's turned it into a CommTimeout (an Exception, so
    `except Exception` swallowed it) that said "within None s"."""
    lane = Lanes("test-lane")
    release = threading.Event()
    try:
        task = lane.submit(0, "slow", lambda: release.wait(30))

        class Interrupted:
            def wait(self, timeout: float | None = None) -> None:
                raise KeyboardInterrupt

            def done(self) -> bool:
                return task.done()

        work = PlaitWork("rank 0: test", [Interrupted()], [], timeout=30)  # type: ignore[list-item]
        with pytest.raises(KeyboardInterrupt):
            work.wait()
        assert not work.is_completed()
    finally:
        release.set()
        lane.stop(10)


def test_ctrl_c_that_ended_the_call_is_raised_once_then_its_error() -> None:
    """Where the waiting thread ran the call and Ctrl-C ended it, plait's Work raises the
    KeyboardInterrupt in that wait and a CommError in later ones: PlaitWork raised the
    CommError at once, which `except Exception` swallowed."""

    class Ended:
        waits = 0

        def wait(self, timeout: float | None = None) -> None:
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt
            raise plait.CommError("rank 0: allreduce did not finish: KeyboardInterrupt")

        def done(self) -> bool:
            return True

    work = PlaitWork("rank 0: test", [Ended()], [], timeout=30)  # type: ignore[list-item]
    with pytest.raises(KeyboardInterrupt):
        work.wait()
    with pytest.raises(plait.CommError, match="did not finish"):
        work.wait()


def test_reworded_argument_errors_and_plaits_own() -> None:
    """A late argument error is raised in the caller's terms, once; plait's own pass unchanged."""
    lane = Lanes("test-lane")

    def fail(exc: BaseException) -> None:
        raise exc

    try:
        late = ValueError("recv_counts disagree")
        task = lane.submit(0, "late", lambda: fail(late))
        work = Reworded(task, lambda e: ValueError(f"torch ({e})"))
        with pytest.raises(ValueError, match=r"torch \(recv_counts disagree\)") as first:
            work.wait()
        assert first.value.__cause__ is late
        with pytest.raises(ValueError, match="torch") as again:
            work.wait(0)
        assert again.value is first.value
        own = plait.UnsupportedError("plait's own")  # a ValueError too, but plait's
        other = Reworded(lane.submit(0, "own", lambda: fail(own)), lambda e: ValueError("no"))
        with pytest.raises(plait.UnsupportedError) as info:
            other.wait()
        assert info.value is own
    finally:
        lane.stop(10)


def test_finish_step_runs_once_after_success() -> None:
    lane = Lanes("test-lane")
    runs: list[int] = []
    try:
        task = lane.submit(0, "ok", lambda: None)
        work = PlaitWork("rank 0: x", [task], [], finish=lambda: runs.append(1), timeout=30)
        work.wait()
        work.wait()
        work.get_future().wait()
        assert runs == [1]
    finally:
        lane.stop(10)


# -- lanes (Note [lanes that end]) -------------------------------------------------------------
def test_a_lane_ends_when_it_runs_empty_and_its_thread_soon_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new key for every task (a tag per message) leaves no lane behind, and the threads
    go on from lane to lane: each key kept a thread of its own until the group was destroyed."""
    monkeypatch.setattr(_work, "_LANE_IDLE", 0.2)
    lanes = Lanes("test-lanes")
    try:
        for key in range(300):
            assert lanes.submit(("send", 1, key), "one", lambda: None).wait(10) is None
        assert lanes.threads() <= 2  # one that runs them; at most one more still ending
        deadline = time.monotonic() + 10
        while (lanes.lanes(), lanes.threads()) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (lanes.lanes(), lanes.threads()) == (0, 0)
        assert lanes.submit("again", "after", lambda: 7).wait(10) == 7  # a new thread
    finally:
        lanes.stop(10)


def test_a_task_submitted_as_its_lane_ends_is_never_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers that end at once (no idle wait): every submit races a lane running empty and
    a worker ending, and every task still runs, each lane's in submission order."""
    monkeypatch.setattr(_work, "_LANE_IDLE", 0.0)
    lanes = Lanes("test-lanes")
    ran: dict[int, list[int]] = {0: [], 1: []}
    try:

        def submitter(key: int) -> None:
            for i in range(1500):
                task = lanes.submit(key, f"task {i}", lambda i=i: ran[key].append(i))
                if i % 3 == 0:
                    task.wait(10)  # now and then the lane runs empty right after

        threads = [threading.Thread(target=submitter, args=(k,)) for k in ran]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        last = [lanes.submit(k, "last", lambda: None) for k in ran]
        for task in last:
            task.wait(10)
        assert ran == {0: list(range(1500)), 1: list(range(1500))}
    finally:
        lanes.stop(10)


def test_a_blocked_lane_holds_up_no_other_and_stop_runs_what_is_queued() -> None:
    lanes = Lanes("test-lanes")
    release = threading.Event()
    blocked = lanes.submit("a", "blocked", lambda: release.wait(30))
    queued = lanes.submit("a", "queued behind it", lambda: "ran")
    assert lanes.submit("b", "another lane", lambda: 2).wait(10) == 2
    assert not blocked.done()
    threading.Timer(0.1, release.set).start()
    lanes.stop(10)  # waits for "a" to run empty
    assert queued.wait(0) == "ran"
    assert lanes.threads() == 0
    with pytest.raises(RuntimeError, match="shut down"):
        lanes.submit("a", "late", lambda: None)


def test_a_thread_that_cannot_start_leaves_no_lane_without_a_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker thread that could not start (threads run out) left its lane registered with
    no worker: later tasks of that lane queued behind it for good, and stop() raised
    "cannot join thread before it is started"."""
    lanes = Lanes("test-lanes")
    real = threading.Thread.start
    failed = []

    def start_once_failing(self: threading.Thread) -> None:
        if self.name.startswith("test-lanes") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            lanes.submit("a", "first", lambda: 1)
        assert (lanes.lanes(), lanes.threads()) == (0, 0)
        assert lanes.submit("a", "second", lambda: 2).wait(10) == 2
    finally:
        lanes.stop(10)
    assert failed


class _FakeWork:
    """A plait work that ends ``after`` seconds from now, with ``error`` if given."""

    def __init__(self, after: float, error: BaseException | None = None) -> None:
        self.end = time.monotonic() + after
        self.error = error

    def done(self) -> bool:
        return time.monotonic() >= self.end

    def wait(self, timeout: float | None = None) -> None:
        left = self.end - time.monotonic()
        if timeout is not None and left > timeout:
            time.sleep(timeout)
            raise plait.CommTimeout(f"did not finish within {timeout} s of wait()")
        time.sleep(max(left, 0.0))
        if self.error is not None:
            raise self.error


def test_a_coalesced_call_whose_first_collective_failed_raises_once_all_have_ended() -> None:
    """A coalesced call of several dtypes whose first collective failed raised its error at
    once, while the next still ran: the work, which reads done() to tell the call's error
    from its wait's timeout, reported a timeout of the wait in place of the error."""
    from plait.torch._coalesced import _All

    failed = plait.MismatchError("rank 0: allgather: rank 1 is in a different call")
    works = [_FakeWork(0.0, failed), _FakeWork(0.3)]
    pending = _All(works)
    with pytest.raises(plait.MismatchError):
        pending.wait(None)
    assert pending.done()
    slow = _All([_FakeWork(0.0, failed), _FakeWork(30.0)])
    with pytest.raises(plait.CommTimeout):  # the wait's own timeout: not the call's error
        slow.wait(0.1)
    assert not slow.done()


# -- errors of a sub-group: its ranks by their global ranks too ----------------------------
@pytest.fixture
def sub_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[list[plait.torch.ProcessGroupPlait]]:
    """Two threads' groups over one in-process fabric, as ``new_group([1, 2])`` makes them."""
    monkeypatch.setenv("PLAIT_DUMP_DIR", str(tmp_path))  # the failed calls' dumps
    comms = memory_communicators(2, timeout=10)
    groups = [plait.torch.ProcessGroupPlait(c, global_ranks=[1, 2]) for c in comms]
    try:
        yield groups
    finally:
        for g in groups:
            g.shutdown()


def all_reduce_opts(async_op: bool) -> object:
    opts = C10D.AllreduceOptions()
    opts.asyncOp = async_op
    return opts


@pytest.mark.parametrize("how", ["blocking", "wait", "future"])
def test_a_lost_peer_of_a_sub_group_is_named_by_its_global_rank(
    sub_group: list[plait.torch.ProcessGroupPlait], how: str
) -> None:
    """The group's rank 0 is global rank 1, its rank 1 global rank 2 (which left)."""
    sub_group[1].communicator.close()

    def call() -> None:
        work = sub_group[0].allreduce([torch.ones(3)], all_reduce_opts(how != "blocking"))
        work.wait() if how == "wait" else work.get_future().wait()

    with pytest.raises(plait.PeerLostError) as info:
        call()
    text = str(info.value)
    assert text.startswith("rank 0 (global rank 1): allreduce"), text
    assert "rank 1 (global rank 2) closed its communicator during the call" in text, text
    assert info.value.lost_rank == 1  # plait's attribute names the group's rank
    assert "global" not in str(info.value.__cause__)  # chained to plait's own
    # the group is unusable now, and says so in the same terms
    with pytest.raises(plait.CommError, match=r"^rank 0 \(global rank 1\): allreduce: .*unusable"):
        sub_group[0].allreduce([torch.ones(3)], all_reduce_opts(False))


def test_a_mismatch_in_a_sub_group_names_global_ranks(
    sub_group: list[plait.torch.ProcessGroupPlait],
) -> None:
    errors: dict[int, BaseException] = {}

    def broadcast() -> None:
        opts = C10D.BroadcastOptions()
        opts.asyncOp = False
        try:
            sub_group[1].broadcast([torch.ones(3)], opts)
        except BaseException as exc:
            errors[1] = exc

    thread = threading.Thread(target=broadcast)
    thread.start()
    try:
        sub_group[0].allreduce([torch.ones(3)], all_reduce_opts(True)).wait()
    except BaseException as exc:
        errors[0] = exc
    thread.join(30)
    assert isinstance(errors[0], plait.MismatchError), repr(errors.get(0))
    assert isinstance(errors[1], plait.MismatchError), repr(errors.get(1))
    assert "rank 0 (global rank 1): allreduce" in str(errors[0])
    assert "rank 1 (global rank 2) is in a different call" in str(errors[0])
    assert "rank 1 (global rank 2): broadcast" in str(errors[1])
    assert "rank 0 (global rank 1) is in a different call" in str(errors[1])


def test_object_calls_and_send_object_of_a_sub_group_name_global_ranks(
    sub_group: list[plait.torch.ProcessGroupPlait],
) -> None:
    sub_group[1].communicator.close()
    with pytest.raises(plait.PeerLostError, match=r"rank 1 \(global rank 2\)"):
        dist.all_gather_object([None, None], {"a": 1}, group=sub_group[0])
    with pytest.raises(plait.CommError, match=r"^rank 0 \(global rank 1\)"):
        sub_group[0].send_object({"a": 1}, 1)


def test_a_receive_on_a_broken_sub_group_names_global_ranks(
    sub_group: list[plait.torch.ProcessGroupPlait],
) -> None:
    """A receive is posted on the caller's thread: its refusal on a broken group named the
    group's ranks alone, where every other call of the group names global ranks too."""
    sub_group[1].communicator.close()
    with pytest.raises(plait.PeerLostError):
        sub_group[0].allreduce([torch.ones(3)], all_reduce_opts(False))
    with pytest.raises(plait.CommError, match=r"^rank 0 \(global rank 1\): irecv: .*unusable"):
        sub_group[0].recv([torch.zeros(2)], 1, 0)
    with pytest.raises(plait.CommError, match=r"^rank 0 \(global rank 1\): irecv: .*unusable"):
        sub_group[0].recv_anysource([torch.zeros(2)], 0)


def test_globally_named_rewords_plaits_errors_once() -> None:
    names = [3, 5, 7]
    lost = plait.PeerLostError("rank 0: allreduce (ring, call #4): rank 2 was lost; see rank0.json")
    lost.lost_rank = 2
    got = globally_named(lost, names)
    assert type(got) is plait.PeerLostError
    assert str(got) == (
        "rank 0 (global rank 3): allreduce (ring, call #4): rank 2 (global rank 7) was lost; "
        "see rank0.json"
    )
    assert got.lost_rank == 2
    assert got.__cause__ is lost
    assert globally_named(got, names) is got  # named already: nothing to add
    assert globally_named(lost, None) is lost  # the default group's ranks are global
    value = ValueError("rank 1 is not plait's error")
    assert globally_named(value, names) is value
    slow = plait.CollectiveTimeout("rank 1: barrier (arena) timed out waiting for rank(s) [0, 2]")
    worded = globally_named(timed_out(slow, "rank 1 (global rank 5): barrier", 1.0), names)
    assert type(worded) is plait.CollectiveTimeout
    assert str(worded) == (
        "rank 1 (global rank 5): barrier: Timed out after 1 s: rank 1 (global rank 5): barrier "
        "(arena) timed out waiting for rank(s) [0, 2] (global rank(s) [3, 7])"
    )


# -- the store adapter and env:// under plait run -------------------------------------------
def test_torch_store_through_plaits_contract() -> None:
    store = plait.torch.TorchStore(dist.PrefixStore("g/", dist.HashStore()), timeout=5)
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2
    assert store.get("n") == b"2"
    assert store.check(["a", "n"])
    assert not store.check(["a", "zz"])
    assert store.delete("a")
    assert not store.check(["a"])
    # plait.init's per-process count of init calls is dropped from the keys
    store.set("plait/init7/host/0", b"h")
    assert store.get("plait/init2/host/0") == b"h"
    with pytest.raises(StoreTimeout, match="missing"):
        store.wait(["missing"], timeout=0.05)
    assert store.host is None  # a HashStore has none; a TCPStore's host routes plait's TCP


def test_torch_store_host_of_a_tcp_store() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    store = plait.torch.TorchStore(dist.PrefixStore("x/", server), timeout=5)
    assert store.host == "127.0.0.1"


@pytest.mark.parametrize("what", ["get", "wait", "set", "add", "check", "delete"])
def test_torch_store_says_its_connection_broke(what: str) -> None:
    """A TCPStore whose server went away raised torch's raw DistNetworkError ("Failed to
    recv, got 0 bytes"), or, while waiting, a StoreTimeout that blamed missing keys."""
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False)
    store = plait.torch.TorchStore(client, timeout=5)
    store.set("a", b"1")
    del server  # its host went away
    calls = {
        "get": lambda: store.get("b", 2),
        "wait": lambda: store.wait(["b"], 2),
        "set": lambda: [store.set("c", b"x") for _ in range(50)],  # the first may be sent
        "add": lambda: store.add("n", 1),
        "check": lambda: store.check(["a"]),
        "delete": lambda: store.delete("a"),
    }
    with pytest.raises(plait.RendezvousError, match="torch store: the connection broke during"):
        calls[what]()


def test_env_rendezvous_under_plait_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without MASTER_ADDR but with plait run's variables, env:// finds a TCPStore."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with TCPStoreServer("127.0.0.1", 0) as server:
        monkeypatch.setenv("PLAIT_RANK", "0")
        monkeypatch.setenv("PLAIT_SIZE", "1")
        monkeypatch.setenv("PLAIT_STORE", f"tcp://127.0.0.1:{server.port}")
        store, rank, size = next(dist.rendezvous("env://"))
        assert (rank, size) == (0, 1)
        assert isinstance(store, dist.TCPStore)
        store.set("k", "v")
        assert store.get("k") == b"v"


def test_env_rendezvous_without_plait_run_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "RANK", "PLAIT_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="RANK expected"):
        next(dist.rendezvous("env://"))
