"""The worker that runs async calls, and the waits that run its jobs themselves."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import plait
from plait.runtime.work import Work, Worker, let_go
from plait.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


def _job(work: Work[Any], log: list[tuple[str, str]], name: str) -> Callable[[], None]:
    def job() -> None:
        log.append((name, threading.current_thread().name))
        work._finish(name)

    return job


def _raised(wait: Callable[[], Any]) -> BaseException | None:
    """What ``wait()`` raises, caught here: a KeyboardInterrupt raised where a test expects
    another error would stop the whole test run."""
    try:
        wait()
    except BaseException as exc:
        return exc
    return None


def _cause(work: Work[Any]) -> BaseException | None:
    """What interrupted ``work``'s call: the cause of the CommError its later waits raise."""
    error = work.exception()
    assert isinstance(error, plait.CommError)
    return error.__cause__


def test_a_wait_runs_the_jobs_up_to_its_own_on_the_waiting_thread() -> None:
    """With the worker thread idle (here: gone), ``wait()`` runs the queued jobs from the
    head of the queue up to its own, in order, and leaves the later ones queued."""
    w = Worker("plait-test")
    w.stop()  # the thread has ended: only a waiter can run what is queued now
    log: list[tuple[str, str]] = []
    works = [Work[Any](f"call {i}") for i in range(3)]
    for i, work in enumerate(works):
        w.submit(_job(work, log, f"call {i}"), work)
    me = threading.current_thread().name
    assert works[1].wait() == "call 1"
    assert log == [("call 0", me), ("call 1", me)]
    assert works[0].done()
    assert not works[2].done()
    assert works[2].wait() == "call 2"
    assert log[-1] == ("call 2", me)


def test_a_wait_with_a_timeout_leaves_the_job_to_the_worker() -> None:
    w = Worker("plait-test")
    w.stop()
    work = Work[Any]("call")
    w.submit(_job(work, [], "call"), work)
    with pytest.raises(plait.CommTimeout):
        work.wait(timeout=0.01)
    assert not work.done()


def test_a_wait_never_runs_a_job_beside_the_workers() -> None:
    """While the worker thread runs a job, a waiter runs none (one job at a time, in order):
    it waits, and the worker thread runs the rest."""
    w = Worker("plait-test")
    gate, started = threading.Event(), threading.Event()
    first = Work[Any]("first")

    def blocked() -> None:
        started.set()
        gate.wait(30)
        first._finish("first")

    w.submit(blocked, first)
    assert started.wait(30)
    log: list[tuple[str, str]] = []
    second = Work[Any]("second")
    w.submit(_job(second, log, "second"), second)
    waiter = threading.Thread(target=second.wait, name="waiter")
    waiter.start()
    gate.set()
    waiter.join(30)
    assert log == [("second", "plait-test")] or log == [("second", "waiter")]
    assert first.wait() == "first"
    assert second.wait() == "second"
    w.stop()


def test_an_interrupted_job_stops_the_wait_and_leaves_the_rest_queued() -> None:
    """A KeyboardInterrupt in a call the waiting thread runs fails that call (the job keeps
    it) and ends the wait with it: the wait does not go on to run the calls behind it."""
    w = Worker("plait-test")
    w.stop()
    first, second = Work[Any]("first"), Work[Any]("second")
    w.submit(lambda: first._finish(error=KeyboardInterrupt()), first)
    w.submit(lambda: second._finish("second"), second)
    with pytest.raises(KeyboardInterrupt):
        second.wait()
    assert isinstance(_cause(first), KeyboardInterrupt)  # (Note [an interrupted wait])
    assert not second.done()  # left to the worker (gone here: run by the next wait)
    assert second.wait() == "second"


def test_a_job_interrupted_before_it_began_fails_its_work() -> None:
    """An interrupt between taking a job and its own catch fails that job's Work, so that no
    wait for it hangs, and frees the worker for the rest."""
    w = Worker("plait-test")
    w.stop()
    first, second = Work[Any]("first"), Work[Any]("second")

    def interrupted() -> None:
        raise KeyboardInterrupt

    w.submit(interrupted, first)
    w.submit(lambda: second._finish("second"), second)
    with pytest.raises(KeyboardInterrupt):
        first.wait()
    assert isinstance(_cause(first), KeyboardInterrupt)
    again = _raised(first.wait)  # not the old interrupt again (Note [an interrupted wait])
    assert isinstance(again, plait.CommError)
    assert "did not finish: KeyboardInterrupt" in str(again)
    assert second.wait() == "second"


def test_an_interrupt_is_raised_by_the_wait_it_interrupted_only() -> None:
    """Every later wait of a call interrupted in a wait raised the same KeyboardInterrupt
    again, a second Ctrl-C to a program that caught the first and waited on its works as it
    cleaned up. Now later waits, of any thread, raise a CommError chained from it; a call the
    worker thread ran that ended so (a SystemExit from a Python op) gives one in every wait
    (Note [an interrupted wait])."""
    w = Worker("plait-test")
    w.stop()
    first = Work[Any]("rank 0: allreduce (ring, call #0)")
    interrupt = KeyboardInterrupt()
    interrupt.add_note("its peers were told")

    def interrupted() -> None:
        try:
            raise interrupt
        except BaseException as exc:  # as a call's job catches what its call raises
            first._finish(error=exc)

    w.submit(interrupted, first)
    with pytest.raises(KeyboardInterrupt) as raised:
        first.wait()
    assert raised.value is interrupt
    elsewhere: list[BaseException | None] = []
    other = threading.Thread(target=lambda: elsewhere.append(_raised(first.wait)))
    other.start()
    other.join(10)
    later = [_raised(first.wait), _raised(first.wait)]
    assert elsewhere == later[:1]
    assert later[1] is later[0]
    assert first.exception() is later[0]
    assert type(later[0]) is plait.CommError
    assert later[0].__cause__ is interrupt
    assert str(later[0]) == (
        "rank 0: allreduce (ring, call #0) did not finish: KeyboardInterrupt interrupted "
        "it on this rank; its peers were told"
    )
    ran = Work[Any]("call")
    ran._finish(error=SystemExit(3))  # on the worker thread: no wait was interrupted
    with pytest.raises(plait.CommError, match="did not finish: SystemExit interrupted it"):
        ran.wait()


def test_stop_waits_for_a_job_a_waiting_thread_runs() -> None:
    w = Worker("plait-test")
    with w._cv:
        w._busy = True  # as a waiting thread running a job marks it
    stopper = threading.Thread(target=w.stop)
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # not while the job runs
    w._free()
    stopper.join(10)
    assert not stopper.is_alive()


def test_async_calls_waited_for_in_any_order_give_the_blocking_results() -> None:
    def body(comm: plait.Communicator) -> Any:
        got = []
        for n in (1, 7, 1000):
            works = [
                comm.allreduce(np.full(n, i + comm.rank, np.float32), async_op=True)
                for i in range(4)
            ]
            order = [2, 0, 3, 1]
            got.append([works[k].wait() for k in order])
            got.append(comm.allreduce(np.full(n, comm.rank, np.float32), async_op=True).wait())
        return got

    for got in run_ranks(3, body):
        for j, n in enumerate((1, 7, 1000)):
            for k, r in zip([2, 0, 3, 1], got[2 * j], strict=True):
                assert np.array_equal(r, np.full(n, 3 * k + 3, np.float32))
            assert np.array_equal(got[2 * j + 1], np.full(n, 3, np.float32))


def test_waits_on_a_failed_call_do_not_grow_its_traceback() -> None:
    """Each wait raised the one stored exception again, which added its frames to the
    traceback it kept: 20,000 waits, 40,004 frames and 12.8 MB."""

    def failed() -> None:
        raise plait.MismatchError("rank 0: allreduce: the ranks' calls differ")

    work = Work[Any]("rank 0: allreduce")
    try:
        failed()
    except plait.MismatchError as exc:
        work._finish(error=exc)
    depths = []
    for _ in range(50):
        with pytest.raises(plait.MismatchError) as info:
            work.wait()
        tb, n = info.value.__traceback__, 0
        while tb is not None:
            n, tb = n + 1, tb.tb_next
        depths.append(n)
    assert len(set(depths)) == 1, depths


def test_close_returns_while_another_thread_issues_async_calls() -> None:
    """close() stopped the worker, which ran until its queue was empty, while another thread
    kept queueing: close() never returned; and calls queued once the worker had ended never
    ran, their done() False for ever. Calls made once close() has begun raise ClosedError."""
    from plait.testing import memory_communicators

    for _ in range(10):
        comm = memory_communicators(1, timeout=5)[0]
        works: list[Any] = []
        going = threading.Event()

        def issue(
            c: plait.Communicator = comm, out: list[Any] = works, going: threading.Event = going
        ) -> None:
            while True:
                try:
                    out.append(c.allreduce(np.ones(8), async_op=True))
                except plait.ClosedError:
                    return
                if len(out) == 20:
                    going.set()

        issuer = threading.Thread(target=issue)
        issuer.start()
        assert going.wait(10)
        closer = threading.Thread(target=comm.close)
        closer.start()
        closer.join(10)
        issuer.join(10)
        assert not closer.is_alive()
        assert not issuer.is_alive()
        assert all(w.done() for w in works)


def test_an_async_call_that_meets_close_makes_no_worker_close_never_sees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Note [one worker]: a first async call that had passed its checks as close() ran made
    the worker after close() had looked for one; its thread waited for jobs for good."""
    import plait._runner as runner_module
    from plait.testing import memory_communicators

    [comm] = memory_communicators(1)
    made = Work.__init__

    def closing(self: Work[Any], describe: str, owner: object = None) -> None:  # close() here
        made(self, describe, owner)
        comm.close()

    monkeypatch.setattr(runner_module, "Work", type("Closing", (Work,), {"__init__": closing}))
    before = set(threading.enumerate())
    with pytest.raises(plait.ClosedError, match="being closed"):
        comm.allreduce(np.ones(3), async_op=True)
    assert [t.name for t in set(threading.enumerate()) - before] == []  # no worker thread left


def test_first_async_calls_of_two_threads_share_one_worker() -> None:
    from plait.runtime.work import LazyWorker

    lazy = LazyWorker("plait-test-lazy")
    start = threading.Barrier(8)
    got: list[Worker | None] = []

    def first() -> None:
        start.wait(10)
        got.append(lazy.get())

    threads = [threading.Thread(target=first) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 8
    assert all(w is got[0] for w in got)
    lazy.close()
    assert lazy.get() is None  # none is made once close() has begun
    assert not [t for t in threading.enumerate() if t.name == "plait-test-lazy"]


class _InterruptedPop(collections.deque):  # type: ignore[type-arg]
    """A queue whose popleft is interrupted as it returns, as a signal's handler can be."""

    def popleft(self) -> Any:
        super().popleft()
        raise KeyboardInterrupt


def test_a_job_interrupted_as_it_leaves_the_queue_fails_its_work() -> None:
    """An interrupt as popleft returned lost the job: its Work was never finished, and every
    wait for it waited out its timeout (Note [an interrupt under the lock])."""
    w = Worker("plait-test")
    w.stop()
    first, second = Work[Any]("first"), Work[Any]("second")
    w.submit(lambda: first._finish("first"), first)
    w.submit(lambda: second._finish("second"), second)
    w._queue = _InterruptedPop(w._queue)
    with pytest.raises(KeyboardInterrupt):
        second.wait()
    assert isinstance(_cause(first), KeyboardInterrupt)
    assert not w._busy
    w._queue = collections.deque(w._queue)
    assert second.wait() == "second"


def test_a_worker_freed_by_an_interrupted_free_is_free() -> None:
    """An interrupt on the way into _free left the worker busy for good: no job ran again."""
    w = Worker("plait-test")
    w.stop()
    first, second = Work[Any]("first"), Work[Any]("second")
    w.submit(lambda: first._finish("first"), first)
    w.submit(lambda: second._finish("second"), second)
    free, calls = w._free, []

    def interrupted_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        free()

    w._free = interrupted_once  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        second.wait()
    assert first.wait() == "first"
    assert not w._busy
    assert second.wait() == "second"


def test_a_lock_taken_as_an_interrupt_came_is_let_go() -> None:
    lock = threading.RLock()
    lock.acquire()
    let_go(lock)  # held here: released
    assert lock.acquire(blocking=False)
    lock.release()
    held = threading.Event()
    done = threading.Event()

    def other() -> None:
        with lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=other)
    t.start()
    held.wait(10)
    let_go(lock)  # another thread's: left alone
    assert not lock.acquire(blocking=False)
    done.set()
    t.join(10)


def test_the_worker_of_a_communicator_dropped_without_close_ends() -> None:
    # Its thread waited for jobs for the life of the process.
    import gc

    comm = plait.init()
    work = comm.allreduce(np.ones(3), async_op=True)
    assert work.wait().tolist() == [1.0, 1.0, 1.0]
    worker = comm._runner._worker._worker
    assert worker is not None
    thread = worker._thread
    del comm, work, worker
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_stop_under_the_job_this_thread_runs_for_a_wait_returns() -> None:
    # A signal handler's close() over Work.wait() landed here: stop joined the worker
    # thread, which waited for the job suspended under the handler, for good.
    w = Worker("plait-test")
    stopped = threading.Event()
    work = Work[Any]("call")

    def job() -> None:  # the handler, running on the thread that runs the job
        w.stop()
        stopped.set()
        work._finish("done")

    def waiter() -> None:
        with w._cv:  # the worker thread cannot take the job: the wait runs it
            w.submit(job, work)
            w.help(threading.Event())

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    t.join(10)
    assert stopped.is_set()
    assert work.wait() == "done"
    w._thread.join(10)
    assert not w._thread.is_alive()
