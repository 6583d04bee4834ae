"""Ctrl-C in ``Work.wait()``: what it leaves depends on who runs the call at that moment
(Note [an interrupted wait] in plait.runtime.work), and a later wait never raises the old
KeyboardInterrupt again.

The interrupt is put where each case has it, deterministically: inside the call the
waiting thread runs (a Python op that raises it), or as a real SIGINT to the main thread
while the worker thread runs the call.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import plait
from plait.runtime.work import Worker
from plait.testing import memory_communicators, run_ranks

pytestmark = pytest.mark.timeout(60)


def _raised(wait: Callable[[], Any]) -> BaseException | None:
    """What ``wait()`` raises, caught here (a KeyboardInterrupt would stop the test run)."""
    try:
        wait()
    except BaseException as exc:
        return exc
    return None


def test_ctrl_c_in_a_call_the_waiter_runs_is_raised_once_then_a_comm_error() -> None:
    """Every later wait re-raised the same old KeyboardInterrupt: a program that caught
    Ctrl-C and waited on its pending works as it cleaned up got a second one. Now only the
    interrupted wait raises it; later waits, of any thread, raise a CommError chained from
    it that says what the failure left."""
    waiter: list[threading.Thread] = []

    def add(a: Any, b: Any, out: Any = None) -> Any:
        if a.size > 1 and threading.current_thread() in waiter:  # not the dtype's probe
            raise KeyboardInterrupt  # as Ctrl-C lands in the call the waiter runs
        return np.add(a, b, out=out)

    op = plait.Op(add, name="interrupted_add")

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            with contextlib.suppress(plait.PeerLostError):  # it may end before rank 0 gives up
                comm.allreduce(np.ones(1000), op=op)
            with pytest.raises(plait.CommError):  # rank 0 gave up on its call
                comm.barrier()
            return None
        # Rank 0's worker thread has ended: only a wait can run its calls (Note [a waiter
        # runs the call] in plait.runtime.work), so this one runs it on this thread.
        stopped = Worker("plait-test")
        stopped.stop()
        comm._runner._worker._worker = stopped
        waiter.append(threading.current_thread())
        work = comm.allreduce(np.ones(1000), op=op, async_op=True)
        with pytest.raises(KeyboardInterrupt) as interrupt:
            work.wait()
        assert work.done()
        later = [_raised(work.wait), _raised(work.wait)]
        elsewhere: list[BaseException | None] = []
        other = threading.Thread(target=lambda: elsewhere.append(_raised(work.wait)))
        other.start()
        other.join(30)
        assert len(elsewhere) == 1
        for error in [*later, *elsewhere, work.exception()]:
            assert type(error) is plait.CommError
            assert error.__cause__ is interrupt.value
        message = str(later[0])
        assert "did not finish: KeyboardInterrupt interrupted it on this rank" in message
        assert "this communicator is unusable now" in message
        with pytest.raises(plait.CommError, match="unusable after an earlier failure"):
            comm.allreduce(np.ones(3))
        return None

    run_ranks(2, body)


def test_ctrl_c_in_a_wait_while_the_worker_runs_the_call_leaves_it_running() -> None:
    """The other case, as documented: the call goes on on the worker thread, a later wait
    returns its result, and the communicator stays usable."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a signal's handler runs on the main thread only")
    comms = memory_communicators(2, timeout=30)
    interrupted = threading.Event()

    def rank1() -> None:
        interrupted.wait(30)  # joins the call only once rank 0's wait was interrupted
        comms[1].allreduce(np.ones(4))
        comms[1].barrier()

    def ctrl_c() -> None:
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    def wait_through_ctrl_c(work: plait.Work) -> None:
        threading.Thread(target=ctrl_c).start()
        work.wait(timeout=30)  # with a timeout the worker thread runs the call

    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    peer = threading.Thread(target=rank1)
    peer.start()
    try:
        work = comms[0].allreduce(np.ones(4), async_op=True)
        with pytest.raises(KeyboardInterrupt):
            wait_through_ctrl_c(work)
        assert not work.done()
        interrupted.set()
        assert work.wait().tolist() == [2.0] * 4
        comms[0].barrier()
    finally:
        signal.signal(signal.SIGINT, handler)
        interrupted.set()
        peer.join(30)
        for comm in comms:
            comm.close()
