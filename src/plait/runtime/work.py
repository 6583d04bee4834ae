"""Work: the handle an ``async_op=True`` call returns."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic

from plait.errors import CommTimeout
from plait.transport.base import background_thread

__all__ = ["Work"]

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    #: What the call returns: ``Work[np.ndarray]`` for ``comm.allreduce(x, async_op=True)``;
    #: a bare ``Work`` is ``Work[Any]``.
    R = TypeVar("R", default=Any)
else:
    from typing import TypeVar

    R = TypeVar("R")  # the default above needs Python 3.13's TypeVar at run time


class Work(Generic[R]):
    """A collective in flight. ``wait()`` returns its result or raises its error.

    The arrays given to the call must not be touched until the work is done;
    the result is the same object the blocking call would have returned, and
    ``Work[R]`` types it as ``R``.
    """

    __slots__ = ("_describe", "_done", "_error", "_result")

    def __init__(self, describe: str) -> None:
        self._describe = describe
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result = result
        self._error = error
        self._done.set()

    def done(self) -> bool:
        """Whether the call has finished, successfully or not (never blocks)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> R:
        """Block until the call finishes and return its result.

        Args:
            timeout: seconds to wait at most; None waits until the call ends
                (it has its own deadline, so this cannot hang forever).

        Raises:
            CommTimeout: ``timeout`` passed first (the call goes on).
            CommError: the call failed.
        """
        if not self._done.wait(timeout):
            raise CommTimeout(f"{self._describe} did not finish within {timeout} s of wait()")
        if self._error is not None:
            raise self._error
        result: R = self._result
        return result

    def exception(self) -> BaseException | None:
        """The error the call failed with, or None (None too while it runs)."""
        return self._error

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "running"
        return f"<plait.Work {self._describe} {state}>"


class Worker:
    """One background thread per communicator that runs async calls in call order."""

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._queue: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._stop = False
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            self._queue.append(job)
            self._cv.notify()

    def _loop(self) -> None:
        background_thread()  # wait without spinning: the caller computes meanwhile
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stop)
                if not self._queue:
                    return
                job = self._queue.pop(0)
            job()

    def stop(self) -> None:
        """Finish queued jobs, then end the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
