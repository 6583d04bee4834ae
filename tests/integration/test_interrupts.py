"""A KeyboardInterrupt (Ctrl-C) that lands inside a call leaves the communicator usable.

A signal's handler runs where the interpreter looks for one, such as a call's return; the
tests put the interrupt in the one place it did harm, deterministically.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import plait
from plait._p2p_request import Request
from plait.testing import run_ranks


class _InterruptedLock:
    """The runner's lock, whose first acquire is interrupted as it returns (held)."""

    def __init__(self, lock: Any) -> None:
        self.lock, self.fired = lock, False

    def acquire(self, *args: Any) -> bool:
        got = self.lock.acquire(*args)
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return bool(got)

    def release(self) -> None:
        self.lock.release()

    def _is_owned(self) -> bool:
        return bool(self.lock._is_owned())

    def __enter__(self) -> Any:
        return self.lock.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.lock.__exit__(*exc)


@pytest.mark.parametrize("call", ["allreduce", "barrier", "allgather_object"])
def test_an_interrupt_as_a_call_takes_the_lock_leaves_it_free(call: str) -> None:
    """The lock stayed held for good: every later call on the communicator, of every
    thread, waited on it with no deadline (Note [an interrupt under the lock]). The second
    call of each kind takes its short path, where there is one."""

    def make(comm: plait.Communicator) -> Any:
        if call == "barrier":
            return comm.barrier()
        return getattr(comm, call)(np.ones(3))

    def body(comm: plait.Communicator) -> Any:
        make(comm)
        if comm.rank == 0:
            runner = comm._runner
            real = runner._lock
            runner._lock = _InterruptedLock(real)
            with pytest.raises(KeyboardInterrupt):
                make(comm)
            runner._lock = real
            got: list[bool] = []  # another thread can take the lock

            def take() -> None:
                got.append(real.acquire(timeout=5))
                if got[0]:
                    real.release()

            took = threading.Thread(target=take)
            took.start()
            took.join(10)
            assert got == [True]
        # The interrupted call took no number: the next one meets the peer's.
        return comm.allreduce(np.full(2, comm.rank + 1.0), timeout=10).tolist()

    assert run_ranks(2, body) == [[3.0, 3.0]] * 2


def test_an_interrupted_blocking_receive_is_withdrawn() -> None:
    """It stayed posted: the message it waited for landed in its buffer, and the next
    receive waited out its timeout (recv_object: MismatchError)."""
    wait = Request._wait_until
    ready = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            ready.wait(10)
            comm.send(np.full(3, 42.0), 0, tag=3)
            return None
        old, new = np.zeros(3), np.zeros(3)

        def interrupted(self: Request[Any], deadline: float, cross: bool = False) -> bool:
            raise KeyboardInterrupt

        Request._wait_until = interrupted  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyboardInterrupt):
                comm.recv(old, 1, tag=3)
        finally:
            Request._wait_until = wait  # type: ignore[method-assign]
        ready.set()
        comm.recv(
            new,
            1,
            tag=3,
        )
        return old.tolist(), new.tolist()

    assert run_ranks(2, body)[0] == ([0.0, 0.0, 0.0], [42.0, 42.0, 42.0])
