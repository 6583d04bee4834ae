"""Work: the handle an ``async_op=True`` call returns."""

from __future__ import annotations

import numbers
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic

import numpy as np

from plait.errors import CommError, CommTimeout
from plait.transport.base import background_thread

__all__ = ["MAX_TIMEOUT", "Work", "check_timeout"]

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    #: What the call returns: ``Work[np.ndarray]`` for ``comm.allreduce(x, async_op=True)``;
    #: a bare ``Work`` is ``Work[Any]``.
    R = TypeVar("R", default=Any)
else:
    from typing import TypeVar

    R = TypeVar("R")  # the default above needs Python 3.13's TypeVar at run time


#: The longest wait a timeout gives, in seconds (about three years): a longer one, infinity
#: included, is taken as this, so that every deadline is a time the OS clock can hold (a
#: wait of 1e300 s used to fail at once with OverflowError).
MAX_TIMEOUT = 1e8


def check_timeout(timeout: Any, where: str, *, poll: bool = False) -> float:
    """``timeout`` as positive float seconds, at most :data:`MAX_TIMEOUT`; ``where`` prefixes
    the message. ``poll``: 0 is taken too, for a wait that may only look (as
    ``concurrent.futures`` takes it).

    Every timeout a caller passes is checked here, from a call's to :meth:`Work.wait`'s (it
    lives at the lowest layer that takes one; ``plait._checks`` exports it to the edge).
    """
    # Any real number: numpy's too (np.float32(5.0), np.int64(5)), as root and tag take them.
    if isinstance(timeout, bool | np.bool_) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{where}: timeout must be a number of seconds; got {timeout!r}")
    seconds = float(timeout)
    if not (seconds >= 0 if poll else seconds > 0):
        said = "0 or more" if poll else "positive"
        raise ValueError(f"{where}: timeout must be {said}; got {timeout}")
    return min(seconds, MAX_TIMEOUT)


class Work(Generic[R]):
    """A collective in flight. ``wait()`` returns its result or raises its error.

    The arrays given to the call must not be touched until the work is done;
    the result is the same object the blocking call would have returned, and
    ``Work[R]`` types it as ``R``.
    """

    __slots__ = ("_describe", "_done", "_error", "_owner", "_result", "_tb", "_worker")

    def __init__(self, describe: str, owner: object = None) -> None:
        self._describe = describe
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._tb: TracebackType | None = None  # the error's, as the call raised it
        self._worker: Worker | None = None  # whose job finishes it (Note [a waiter runs the call])
        # The communicator, kept until the call ends: one dropped with calls queued lets go
        # of its transport only once they are done, as close() would (Note [dropped
        # communicators] in plait._recovery).
        self._owner = owner

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result = result
        if error is not None and not isinstance(error, Exception):
            error = _interrupted(self._describe, error)  # Note [an interrupted wait]
        self._error = error
        self._tb = None if error is None else error.__traceback__
        self._owner = None  # may let go of the communicator, its finalizers running here
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
            CommError: the call failed, or an interrupt (Ctrl-C) ended it, which only the
                wait it interrupted raises (Note [an interrupted wait]).
            KeyboardInterrupt: Ctrl-C, in this wait (Note [an interrupted wait]).
            TypeError, ValueError: ``timeout`` is not a number of seconds, 0 or more (0
                only looks, as :meth:`done` does, and raises CommTimeout if not done).
        """
        if timeout is not None:
            timeout = check_timeout(timeout, f"{self._describe}: wait", poll=True)
        if timeout is None and self._worker is not None and not self._done.is_set():
            self._worker.help(self._done)
        if not self._done.wait(timeout):
            raise CommTimeout(f"{self._describe} did not finish within {timeout} s of wait()")
        error = self._error
        if error is not None:
            # Raised as it was first: each raise of one exception object adds its frames
            # to the traceback it keeps (a loop of waits on a failed call grew it for ever).
            raise error.with_traceback(self._tb)
        result: R = self._result
        return result

    def exception(self) -> BaseException | None:
        """The error the call failed with, or None (None too while it runs); for a call an
        interrupt ended, the CommError that later waits raise (Note [an interrupted wait])."""
        return self._error

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "running"
        return f"<plait.Work {self._describe} {state}>"


class Worker:
    """One background thread per communicator that runs async calls in call order.

    Note [a waiter runs the call]
        An async call is a job in this queue, and the worker thread runs the
        jobs one after the other. A caller that waits for a call the worker has
        not begun (``comm.allreduce(x, async_op=True).wait()``, or a wait after
        a little work) would hand the job to the worker thread and sleep until
        it is done: two wake-ups of a thread and two hand-overs of the GIL, tens
        of µs on a small machine, for a call that takes a few. So ``wait()``
        without a timeout runs the jobs itself instead, from the head of the
        queue up to its own, while the worker thread runs none (``_busy``: one
        job at a time, in call order, whoever runs it). A wait with a timeout
        leaves them to the worker: a job runs to its own deadline, not to the
        wait's. The job is the same either way (its numbers and epoch were
        taken when the call was made), so the results are the same bits; the
        waiting thread may spin before it sleeps, as a blocking call does, where
        the worker thread does not (``background_thread``). A KeyboardInterrupt
        reaches the call a waiting main thread runs, as it reaches a blocking
        call: that call fails with it, and the wait stops and raises it, leaving
        the jobs behind it to the worker (Note [an interrupted wait]). ``stop``
        waits for a job a waiting thread runs, as for the worker's own.

    Note [an interrupted wait]
        Ctrl-C lands in the main thread, and what it does to a ``wait()`` there
        depends on who runs the call at that moment. Where the worker thread
        runs it (the wait had a timeout, or began once the worker had taken the
        job), the KeyboardInterrupt stops the wait only: the call goes on, and
        a later ``wait()`` returns its result. Where the waiting thread runs it
        (Note [a waiter runs the call]), the interrupt lands inside the call,
        as in a blocking call: the call fails midway, its peers are told, and
        the communicator is unusable (Note [errors of a rank's own] in
        plait._failures). Making the two alike would cost every call: a call
        cannot be handed to the worker midway, and keeping Ctrl-C out of the
        call the waiter runs means a signal mask or a handler for each one.

        In the second case only the wait that was interrupted raises the
        KeyboardInterrupt. Every later wait of that Work, on any thread, raises
        a CommError chained from it, saying that the call did not finish and
        what that left: raised again, the old KeyboardInterrupt read as a second
        Ctrl-C to a program that caught the first and waited on its works as it
        cleaned up. ``_finish`` makes that CommError from any error that is not
        an ``Exception`` (what ``except Exception`` lets by), so a job run by
        the worker thread that ended so (a ``SystemExit`` from a Python op)
        gives it too, in every wait; a job the waiting thread ran raises the
        interrupt itself in that wait (``Worker.help``).
    """

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        # The jobs, each with the Work it finishes (None: a job that finishes its own).
        self._queue: deque[tuple[Callable[[], None], Work[Any] | None]] = deque()
        self._busy = False  # a job runs now, on the worker thread or a waiting one
        self._helper = 0  # the waiting thread that runs it (its ident), if one does
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._stop = False
        self._closed = False  # close(): no more jobs
        self._thread.start()

    def submit(self, job: Callable[[], None], work: Work[Any] | None = None) -> bool:
        """Queue ``job``, which finishes ``work``: a wait for ``work`` may run it. False
        (nothing queued) once :meth:`close` was called: jobs that kept coming kept its
        ``stop`` from returning, and a job queued once the thread had ended never ran (its
        ``done()`` stayed False)."""
        with self._cv:
            if self._closed:
                return False
            if work is not None:
                work._worker = self
            self._queue.append((job, work))
            self._cv.notify()
        return True

    def _loop(self) -> None:
        background_thread()  # wait without spinning: the caller computes meanwhile
        cv = self._cv
        while True:
            with cv:
                while self._busy or not self._queue:
                    if self._stop and not self._queue and not self._busy:
                        return
                    cv.wait()
                job, _ = self._queue.popleft()
                self._busy = True
            try:
                job()  # the jobs catch what their calls raise, and keep it for wait()
            finally:
                self._free()

    def help(self, done: threading.Event) -> None:
        """Run queued jobs on this thread, in order, until ``done`` is set, the queue is
        empty or the worker thread runs one (Note [a waiter runs the call]).

        Raises:
            BaseException: what interrupted a job run here (KeyboardInterrupt).
        """
        cv = self._cv
        while not done.is_set():
            mine = False
            work = None
            try:
                with cv:
                    if self._busy or not self._queue:
                        return
                    self._busy = True
                    self._helper = threading.get_ident()
                    mine = True
                    # Its work is known before it leaves the queue: an interrupt as
                    # popleft returns then fails the work, not loses it (Note [an
                    # interrupt under the lock]).
                    job, work = self._queue[0]
                    self._queue.popleft()
                job()
            except BaseException as exc:  # outside the job's own catch: it never began
                if work is not None and not work.done():
                    work._finish(error=exc)
                raise
            finally:
                if mine:
                    try:
                        self._free()
                    except BaseException:  # interrupted on its way in: free it still
                        self._free()
                        raise
            error = work._error if work is not None else None
            cause = error.__cause__ if error is not None else None
            if cause is not None and not isinstance(cause, Exception):
                # Interrupted here: this wait stops and raises the interrupt, later ones the
                # CommError that _finish made of it (Note [an interrupted wait]).
                raise cause

    def _free(self) -> None:
        with self._cv:
            self._busy = False
            self._helper = 0
            self._cv.notify()

    def close(self) -> None:
        """Refuse new jobs (:meth:`submit`), finish the queued ones, then end the thread."""
        with self._cv:
            self._closed = True
        self.stop()

    def stop(self, join: bool = True) -> None:
        """Finish queued jobs, then end the thread (waiting for it where ``join``).

        Called under the job this thread runs for a wait (a signal handler's ``close()``
        over ``Work.wait()``), it waits for nothing: that job resumes only once this
        returns, and the worker thread waits for it before it ends.
        """
        with self._cv:
            self._stop = True
            self._cv.notify()
            under_own_job = self._helper == threading.get_ident()
        if join and not under_own_job and threading.current_thread() is not self._thread:
            self._thread.join()


def _interrupted(describe: str, interrupt: BaseException) -> CommError:
    """What later waits of call ``describe`` raise, where ``interrupt`` (not an ``Exception``:
    Ctrl-C's KeyboardInterrupt) ended it (Note [an interrupted wait])."""
    notes = getattr(interrupt, "__notes__", None)  # what the failure left (plait._failures)
    said = "; " + "; ".join(notes) if notes else ""
    error = CommError(
        f"{describe} did not finish: {type(interrupt).__name__} interrupted it on this rank{said}"
    )
    error.__cause__ = interrupt
    return error


def let_go(lock: Any) -> None:
    """Release ``lock`` (an RLock) where this thread holds it: a call interrupted under it.

    Note [an interrupt under the lock]
        A signal's handler (Ctrl-C's KeyboardInterrupt) runs where the interpreter checks
        for one, and a call's return is such a place: right after ``lock.acquire()``
        returned, before a ``try`` that would release it. The lock was then held for good,
        and every later call of every thread waited on it with no deadline. ``with``
        closes that gap but costs twice as much (80 ns) on every call; so the call runner
        takes its lock inside its ``try``, and where anything interrupts it, lets go of
        the lock if this thread holds it: an RLock knows its owner, and a thread
        interrupted while it waited for the lock holds nothing. The worker's queue is
        guarded the same way (:meth:`Worker.help`).
    """
    if lock._is_owned():
        lock.release()


class LazyWorker:
    """A communicator's :class:`Worker`, made by its first async call.

    Note [one worker]
        Most communicators make no async call, so the worker thread is made by the
        first one. Made without a lock, two threads' first calls could each make one
        (their calls then ran side by side, out of call order, and one thread was
        never stopped), and a call that had passed its checks as ``close()`` ran made
        one that ``close()`` never saw: its thread waited for jobs for good. So it is
        made under a lock that :meth:`close` takes too, and once ``close()`` has
        begun none is made: :meth:`get` returns None, and the call is refused.
    """

    __slots__ = ("_done", "_lock", "_name", "_worker")

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._done = False

    def get(self) -> Worker | None:
        """The worker, made now if it is the first call; None once :meth:`close` began."""
        worker = self._worker
        if worker is not None and not self._done:  # made: no lock (a close() that begins
            return worker  # meanwhile has the worker refuse the job, Worker.submit)
        with self._lock:
            if self._done:
                return None
            if self._worker is None:
                self._worker = Worker(self._name)
            return self._worker

    def let_go(self) -> None:
        """The communicator is gone (a finalizer's call, on whichever thread dropped it):
        make no worker any more, and end the one made once its queued jobs are done,
        waiting for nothing. Without it, the thread of a communicator dropped without
        ``close()`` waited for jobs for the life of the process."""
        self._done = True  # no lock: the finalizer may run inside get() on this thread
        worker = self._worker
        if worker is not None:
            worker.stop(join=False)

    def close(self) -> None:
        """Make no worker any more; close the one made (:meth:`Worker.close`)."""
        with self._lock:
            self._done = True
            worker = self._worker
        if worker is not None:
            worker.close()
