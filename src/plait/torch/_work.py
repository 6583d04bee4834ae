"""Work handles: torch ``Work`` objects over plait's calls in flight.

Note [how a torch Work tracks plait]
    A :class:`PlaitWork` holds what it waits for, *pending*: the
    :class:`plait.Work` of each collective it started (plait runs them on the
    communicator's worker, in call order), or a :class:`Task` that one of
    this backend's :class:`Lanes` runs (point-to-point calls: a blocking
    send, or the wait for a posted receive; Note [point to point on lanes]
    in ``plait.torch._p2p``). Some calls have a *finish* step, run
    once after every pending call succeeded, that copies plait's result into
    torch's output tensors (an all_gather's output list, a strided output).

    ``wait()`` waits in the caller's thread, runs the finish step and raises
    plait's own error if the call failed. ``get_future()`` returns a
    ``torch.futures.Future`` that completes by itself, since DDP's reducer
    chains callbacks on it and waits on the future, not on the work: a
    :class:`Task` completes it from its lane thread; plait's works are watched
    by one :class:`Notifier` thread per process group, started on the first
    ``get_future()``, that waits on them in call order (plait completes
    collectives in call order).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final, Protocol

import torch
import torch.distributed as dist

from plait.errors import CommError, CommTimeout
from plait.torch._convert import seconds

__all__ = [
    "Joined",
    "Lanes",
    "Notifier",
    "PlaitWork",
    "Reworded",
    "Task",
    "globally_named",
    "reworded",
    "timed_out",
]

#: Seconds an idle helper thread sleeps between checks that it should stop.
_IDLE_POLL = 5.0
#: Seconds a lane's worker whose lane ran empty waits to be handed another before it ends.
_LANE_IDLE = 1.0
#: Seconds a watcher waits for a call beyond the call's own deadline.
_GRACE = 30.0
#: The call deadline a watcher assumes when the work was given none.
_DEFAULT_WAIT = 300.0
#: A group rank named in plait's message ("rank 1"), not yet given its global rank; not
#: the global or job rank of another naming ("global rank 2", "job rank 3").
_RANK = re.compile(r"(?<!global )(?<!job )\brank (\d+)\b(?! \(global)")
#: A list of group ranks in plait's message ("rank(s) [1, 2]", "ranks [0, 2]").
_RANKS = re.compile(r"\b(?:rank\(s\)|ranks) \[(\d+(?:, \d+)*)\](?! \(global)")


class Pending(Protocol):
    """What a :class:`PlaitWork` waits for: a plait.Work or a :class:`Task`."""

    def wait(self, timeout: float | None = None) -> Any:
        """The call's result; raises its error, or CommTimeout after ``timeout`` s."""

    def done(self) -> bool:
        """Whether the call has finished (never blocks)."""


class Task:
    """A blocking call that :class:`Lanes` run; done-callbacks run on the lane's thread."""

    __slots__ = ("_callbacks", "_describe", "_done", "_error", "_lock", "_result")

    def __init__(self, describe: str) -> None:
        self._describe = describe
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Task], None]] = []
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` and record its result or error (on the lane's thread)."""
        try:
            result, error = fn(), None
        except BaseException as exc:
            result, error = None, exc
        with self._lock:
            self._result, self._error = result, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def done(self) -> bool:
        """Whether the call has finished (never blocks)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """The call's result; raises its error, or CommTimeout after ``timeout`` s."""
        if not self._done.wait(timeout):
            raise CommTimeout(f"{self._describe} did not finish within {timeout} s of wait()")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, callback: Callable[[Task], None]) -> None:
        """Call ``callback(task)`` once done: now if it is, else on the lane's thread."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)


def reworded(exc: ValueError, reword: Callable[[ValueError], ValueError]) -> ValueError:
    """``reword(exc)``, chained to ``exc``; plait's own errors (CommError) stay as they are."""
    if isinstance(exc, CommError):
        return exc
    error = reword(exc)
    error.__cause__ = exc
    return error


def timed_out(exc: CommTimeout, describe: str, seconds: float | None) -> CommTimeout:
    """plait's timeout as torch's backends word theirs ("Timed out ..."), of the same class.

    Code written for torch (its own test suite among it) recognises a timeout
    by those words; plait's message (which names the ranks waited for) follows.
    """
    after = f" after {seconds:g} s" if seconds is not None else ""
    error = type(exc)(f"{describe}: Timed out{after}: {exc}")
    error.__cause__ = exc
    return error


def globally_named(exc: BaseException, global_ranks: Sequence[int] | None) -> BaseException:
    """plait's error ``exc`` of a sub-group's call, naming each rank by its global rank too.

    plait numbers a group's ranks from 0 (its communicator is the group's),
    while torch's caller knows them by their rank in the default group: "rank
    0: allreduce (...): rank 1 was lost" becomes "rank 0 (global rank 1):
    allreduce (...): rank 1 (global rank 2) was lost", and "rank(s) [1]" gets
    "(global rank(s) [2])", as a timeout's prefix names this rank
    (:func:`timed_out`). The error keeps its class and attributes
    (``lost_rank`` stays the group's rank, as plait documents it) and is
    chained to ``exc``.

    Args:
        exc: the error; only plait's own (CommError) are reworded.
        global_ranks: the global rank of each group rank; None where they are
            the same (the default group): ``exc`` is returned as it is.
    """
    if global_ranks is None or not isinstance(exc, CommError):
        return exc
    names = list(global_ranks)

    def one(m: re.Match[str]) -> str:
        r = int(m.group(1))
        return m.group(0) if r >= len(names) else f"{m.group(0)} (global rank {names[r]})"

    def listed(m: re.Match[str]) -> str:
        ranks = [int(r) for r in m.group(1).split(", ")]
        if any(r >= len(names) for r in ranks):
            return m.group(0)
        return f"{m.group(0)} (global rank(s) {[names[r] for r in ranks]})"

    text = str(exc)
    new = _RANK.sub(one, _RANKS.sub(listed, text))
    if new == text:
        return exc
    try:
        error = type(exc)(new)
    except Exception:  # a class that takes other arguments: as it is, rather than none
        return exc
    error.__dict__.update(exc.__dict__)
    error.__cause__ = exc
    return error


class Reworded:
    """A pending call whose argument error is raised in the caller's terms.

    plait checks some arguments only once every rank's are known (the split
    sizes of an uneven all_to_all are compared after a count exchange); its
    ValueError then speaks of plait's arguments. ``reword(exc)`` makes the
    error torch's caller gets, chained to plait's (:func:`reworded`).
    """

    __slots__ = ("_error", "_pending", "_reword")

    def __init__(self, pending: Pending, reword: Callable[[ValueError], ValueError]) -> None:
        self._pending = pending
        self._reword = reword
        self._error: ValueError | None = None

    def done(self) -> bool:
        """Whether the call has finished (never blocks)."""
        return self._pending.done()

    def wait(self, timeout: float | None = None) -> Any:
        """The call's result; raises its (reworded) error, or CommTimeout after ``timeout`` s."""
        try:
            return self._pending.wait(timeout)
        except ValueError as exc:
            if self._error is None:  # one error object, however often it is asked for
                self._error = reworded(exc, self._reword)
            raise self._error  # noqa: B904 - chained by reworded()


class Lanes:
    """Lanes that run :class:`Task` s, each lane's in submission order (Note [lanes that end]).

    Point-to-point calls with one peer and tag go through one lane per
    direction, so that sends to one peer keep their order, while a send
    blocked until its peer receives never holds up a receive or a send of
    another lane (Note [point to point on lanes] in ``plait.torch._p2p``).

    Note [lanes that end]
        A lane is a queue of tasks under a key ((direction, peer, tag) for
        point to point), not a thread: it exists while it has a task queued
        or running, and a worker thread runs it until it is empty, then drops
        it. So a program that gives every message a tag of its own (a step
        number) leaves no lane behind; it left one thread per tag before,
        each waiting for more until the group was destroyed (8000 tags, 8000
        threads a rank, and a destroy that took seconds to end them).

        Workers are shared: one whose lane ran empty waits up to
        :data:`_LANE_IDLE` s to be handed another and then ends, and a
        submitted lane that finds no idle worker starts one. There are as
        many threads as lanes with work, plus the idle ones of the last
        :data:`_LANE_IDLE` s: a lane whose task blocks (a send waiting for its
        receiver) holds its worker, never another lane's.

        Everything that decides which worker runs which lane happens under
        one lock: a submit to a lane that still exists appends to it, so it
        runs after the lane's earlier tasks, on the worker running them; a
        worker drops its lane only under the lock, with nothing queued and
        nothing running; a submit after that makes a new lane, whose tasks
        can only start once the old lane's last one has finished. An idle
        worker is handed its lane under the lock too, and checks under it
        whether it was handed one before it ends: a lane is never handed to
        a worker that has already left.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        #: each lane with work: its tasks not yet started (empty while its last one runs)
        self._lanes: dict[Hashable, deque[tuple[Task, Callable[[], Any]]]] = {}
        self._idle: list[_Worker] = []  # waiting to be handed a lane, the latest last
        self._threads: set[threading.Thread] = set()
        self._started = 0
        self._stop = False

    def submit(self, key: Hashable, describe: str, fn: Callable[[], Any]) -> Task:
        """Queue ``fn`` on lane ``key``; the returned task completes when it has run.

        Raises:
            RuntimeError: the lanes were stopped.
        """
        task = Task(describe)
        with self._lock:
            if self._stop:
                raise RuntimeError(f"{describe}: the process group is shut down")
            queue = self._lanes.get(key)
            if queue is not None:  # its worker runs it in turn
                queue.append((task, fn))
                return task
            self._lanes[key] = deque([(task, fn)])
            if self._idle:
                worker = self._idle.pop()
                worker.lane = key
                worker.wake.set()
                return task
            worker = _Worker(key)
            self._started += 1
            thread = threading.Thread(
                target=self._work, args=(worker,), name=f"{self._name}-{self._started}", daemon=True
            )
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException as exc:  # no thread to be had: no lane is left without a worker
            with self._lock:
                self._threads.discard(thread)
                queued = self._lanes.pop(key, deque())
            for other, _ in queued:  # queued behind this one meanwhile: they fail with it
                if other is not task:
                    other.run(functools.partial(_raise, exc))
            raise
        return task

    def lanes(self) -> int:
        """How many lanes have work now (queued or running)."""
        with self._lock:
            return len(self._lanes)

    def threads(self) -> int:
        """How many worker threads are alive now, busy or idle."""
        with self._lock:
            return len(self._threads)

    def _work(self, worker: _Worker) -> None:
        key: Hashable = worker.lane
        while True:
            self._run(key)
            with self._lock:
                if self._stop:
                    self._threads.discard(threading.current_thread())
                    return
                worker.lane = _NO_LANE
                worker.wake.clear()
                self._idle.append(worker)
            worker.wake.wait(_LANE_IDLE)
            with self._lock:
                if worker.lane is _NO_LANE:  # none handed over: time to end (or stop)
                    if worker in self._idle:
                        self._idle.remove(worker)
                    self._threads.discard(threading.current_thread())
                    return
                key = worker.lane

    def _run(self, key: Hashable) -> None:
        """Run lane ``key``'s tasks until none is left, then drop the lane."""
        while True:
            with self._lock:
                queue = self._lanes[key]
                if not queue:
                    del self._lanes[key]
                    return
                task, fn = queue.popleft()
            task.run(fn)

    def stop(self, timeout: float) -> None:
        """Refuse new tasks, run what is queued, then end the threads (waiting at most
        ``timeout`` s in all)."""
        with self._lock:
            self._stop = True
            idle, self._idle = self._idle, []
            threads = list(self._threads)
        for worker in idle:
            worker.wake.set()  # handed no lane: it ends
        deadline = time.monotonic() + timeout
        for thread in threads:
            # (one not started yet is about to be: it finds the lanes stopped once its own
            # lane has run, and ends)
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(max(deadline - time.monotonic(), 0.0))


def _raise(exc: BaseException) -> None:
    raise exc


#: What an idle worker's lane is until it is handed one.
_NO_LANE: Final = object()


class _Worker:
    """A thread of :class:`Lanes`: the lane it runs or is handed, and its wake-up."""

    __slots__ = ("lane", "wake")

    def __init__(self, lane: Hashable) -> None:
        self.lane = lane
        self.wake = threading.Event()


class Notifier:
    """Completes the futures of works over plait.Work, waiting on them in call order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[PlaitWork] = deque()
        self._stop = False
        self._thread: threading.Thread | None = None

    def watch(self, work: PlaitWork) -> None:
        """Settle ``work`` (and so complete its future) once its calls finish.

        A future's callbacks run on the thread that completes it, this one; one that makes a
        call and waits for its future (torch's PowerSGD hook does) would wait for this very
        thread, so a work watched from here is settled on a thread of its own.
        """
        if threading.current_thread() is self._thread:
            threading.Thread(
                target=work._settle_quietly, name=f"{self._name}-nested", daemon=True
            ).start()
            return
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._queue.append(work)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait(_IDLE_POLL)
                if not self._queue:
                    return
                work = self._queue.popleft()
            work._settle_quietly()

    def stop(self, timeout: float) -> None:
        """Settle what is queued, then end the thread (waiting at most ``timeout`` s)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and threading.current_thread() is not thread:
            thread.join(timeout)


class PlaitWork(dist.Work):
    """A torch.distributed ``Work`` for a call of the plait backend.

    ``wait()`` returns True once the call is done and raises plait's error
    (a :class:`plait.CommError`, such as :class:`plait.CommTimeout`) if it
    failed; ``get_future()`` gives a future whose value is the call's output
    tensors. See Note [how a torch Work tracks plait]. A sub-group's work is
    given the ``global_ranks`` of its ranks, and its error names them too
    (:func:`globally_named`).
    """

    def __init__(
        self,
        describe: str,
        pending: Sequence[Pending],
        outputs: Any,
        *,
        finish: Callable[[], None] | None = None,
        notifier: Notifier | None = None,
        timeout: float | None = None,
        source_rank: int | Callable[[], int] = -1,
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self._describe = describe
        self._pending = tuple(pending)
        self._outputs = outputs
        self._finish = finish
        self._notifier = notifier
        self._timeout = timeout
        self._source = source_rank
        self._global = global_ranks  # a sub-group's: its errors name them (globally_named)
        self._lock = threading.Lock()
        self._settled = False
        self._error: BaseException | None = None
        self._future: torch.futures.Future[Any] | None = None
        self._future_done = False

    @classmethod
    def completed(cls, describe: str, outputs: Any, source_rank: int = -1) -> PlaitWork:
        """The work of a call that already finished (a blocking call)."""
        work = cls(describe, (), outputs, source_rank=source_rank)
        work._settled = True
        return work

    # -- torch's Work API ---------------------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        """Block until the call is done; True on success, plait's error otherwise.

        Args:
            timeout: a timedelta or seconds to wait at most (zero or None: until
                the call ends; it has its own deadline, so this cannot hang).

        Raises:
            plait.CommTimeout: ``timeout`` passed first (the call goes on).
            plait.CommError: the call failed.
        """
        self._settle(seconds(timeout))
        return True

    def is_completed(self) -> bool:
        """Whether the call has finished, successfully or not (never blocks).

        Once it says True, the output tensors hold the results (the finish
        step has run).
        """
        if self._settled:
            return True
        if not all(p.done() for p in self._pending):
            return False
        with contextlib.suppress(Exception):
            self._settle(None)  # everything is done: this only runs the finish step
        return True

    def is_success(self) -> bool:
        """Whether the call finished without an error (never blocks)."""
        if not self.is_completed():
            return False
        try:
            self._settle(None)
        except Exception:
            return False
        return True

    def exception(self) -> BaseException | None:
        """The error the call failed with; None while it runs or if it succeeded."""
        if self.is_completed():
            try:
                self._settle(None)
            except Exception as exc:
                return exc
        return None

    def result(self) -> Any:
        """The call's output tensors (the future's value)."""
        self._settle(None)
        return self._outputs

    def source_rank(self) -> int:
        """The rank a receive got its message from (-1 for other calls).

        A receive from any source learns it only once done (-1 until then):
        ``source_rank`` was given as a function that asks.
        """
        source = self._source
        return source() if callable(source) else source

    def _source_rank(self) -> int:
        return self.source_rank()

    def get_future(self) -> torch.futures.Future[Any]:
        """A future completed with the output tensors, or with the call's error."""
        with self._lock:
            if self._future is not None:
                return self._future
            future: torch.futures.Future[Any] = torch.futures.Future()
            self._future = future
        tasks = [p for p in self._pending if isinstance(p, Task) and not p.done()]
        others = [p for p in self._pending if not isinstance(p, Task) and not p.done()]
        if others:
            # settles once every call is done
            (self._notifier if self._notifier is not None else _shared_notifier()).watch(self)
        elif tasks:
            remaining = [len(tasks)]
            count_lock = threading.Lock()

            def one_done(_: Task) -> None:
                with count_lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    self._settle_quietly()

            for task in tasks:
                task.add_done_callback(one_done)
        else:
            self._settle_quietly()
        return future

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "running"
        return f"<plait.torch.PlaitWork {self._describe} {state}>"

    # -- settling ------------------------------------------------------------------------
    def _settle(self, timeout: float | None) -> None:
        """Wait for every pending call, then run the finish step once; raise any error."""
        if not self._settled:
            deadline = None if timeout is None else time.monotonic() + timeout
            for p in self._pending:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    p.wait(left)
                except BaseException as exc:
                    if not p.done():  # wait()'s own timeout: the call goes on
                        if not isinstance(exc, Exception):
                            raise  # Ctrl-C in the wait is the user's, as gloo's wait lets it by
                        raise CommTimeout(
                            f"{self._describe}: Timed out: it did not finish within {timeout} s "
                            "of wait(); it goes on"
                        ) from None
                    error = _error_of(p)
                    if isinstance(error, CommTimeout) and not isinstance(p, Joined):
                        error = timed_out(error, self._describe, self._timeout)
                    if error is not None:
                        self._fail_once(globally_named(error, self._global))
                        if not isinstance(exc, Exception):
                            raise  # the Ctrl-C that ended the call, once; later waits its error
                        break
            self._finish_once()
        if self._error is not None:
            raise self._error

    def _fail_once(self, error: BaseException) -> None:
        with self._lock:
            if self._settled:
                return
            self._error = error
            self._settled = True
        self._complete_future()

    def _finish_once(self) -> None:
        with self._lock:
            if self._settled:
                return
            if self._finish is not None:
                try:
                    self._finish()
                except BaseException as exc:
                    self._error = exc
            self._settled = True
        self._complete_future()

    def _complete_future(self) -> None:
        """Complete the future once settled (any thread may get here; one completes it)."""
        with self._lock:
            future = self._future
            if future is None or not self._settled or self._future_done:
                return
            self._future_done = True
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._outputs)

    def _settle_quietly(self) -> None:
        """Settle without raising (for threads that only complete the future)."""
        wait = (self._timeout if self._timeout is not None else _DEFAULT_WAIT) + _GRACE
        try:
            self._settle(wait)
        except CommTimeout as exc:
            self._fail_once(exc)  # the call outlived its own deadline: give up on it
        except BaseException:
            pass  # recorded in self._error and the future
        self._complete_future()


class Joined:
    """Several works waited for as one (the calls of a coalescing block, in call order)."""

    __slots__ = ("_works",)

    def __init__(self, works: Sequence[PlaitWork]) -> None:
        self._works = tuple(works)

    def done(self) -> bool:
        """Whether every call has finished (never blocks)."""
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for every call; raises the first one's error, or CommTimeout after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self._works:
            w.wait(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
        return None


@functools.cache
def _shared_notifier() -> Notifier:
    """The notifier of works made without one (outside a process group)."""
    return Notifier("plait-torch-futures")


def _error_of(p: Pending) -> BaseException | None:
    """The error of the finished call ``p``, or None if it succeeded.

    Asked again because what wait() raised may have been its own timeout, with
    the call finishing just after.
    """
    try:
        p.wait(0)
    except BaseException as exc:
        return exc
    return None
