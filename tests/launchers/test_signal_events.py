"""The launcher's signal handler puts into the queue its main thread waits on.

The handler runs on the main thread between two bytecodes, maybe inside the queue's own
``get``: a ``queue.Queue``'s ``put`` there waited for the lock that ``get`` held, so two
signals close together (GNU ``timeout`` signals the child and then its group) hung the
launcher for good, its ranks still running. The queue is a ``SimpleQueue`` now, whose
``put`` may run inside its ``get``.
"""

from __future__ import annotations

import signal
import threading

import pytest

from plait.launch import job

pytestmark = pytest.mark.timeout(30)


def test_a_signal_put_while_the_queue_is_being_read_is_not_held_up() -> None:
    signals = job._Signals()
    events = job._event_queue()
    signals.events = events
    mutex = getattr(events, "mutex", None)  # a Queue's, which its get holds
    done = threading.Event()

    def handler_inside_get() -> None:
        if mutex is not None:
            with mutex:  # as get holds it when the handler runs
                signals.receive(signal.SIGINT, None)
        else:
            signals.receive(signal.SIGINT, None)
        done.set()

    t = threading.Thread(target=handler_inside_get, daemon=True)
    t.start()
    assert done.wait(5), "the handler's put waited on the queue's own lock"
    assert events.get(timeout=5) == (-1, -signal.SIGINT)
    assert signals.received == signal.SIGINT
