"""``plait.dask.run``: one rank on every worker of a Dask cluster, all at once, with a communicator.

Note [a gang of Dask tasks]
    ``run`` submits one task per worker, pinned there
    (``workers=[address]``, ``allow_other_workers=False``, ``pure=False``),
    so each rank runs in a thread of its worker's pool, as any task does:
    the worker's event loop stays free, so its heartbeats, and the
    scheduler round trips of the rendezvous, go on while ``fn`` blocks in a
    collective. (``Client.run`` would call ``fn`` on the worker's event
    loop itself: a rank blocked in a collective would stop that worker's
    rendezvous and heartbeats.) A task starts only when its worker has a
    free thread, so the ranks meet in two steps before ``plait.init``:

    1. Each rank writes ``started/<rank>`` and waits for ``go``.
    2. ``run`` polls for every ``started`` key (and for tasks that ended
       early) until ``start_timeout``; then it writes ``go``. If some rank
       has not started by then (its worker busy with other tasks, paused,
       or gone: a worker that leaves fails the start at once), it writes
       the reason under ``go`` instead, cancels the
       tasks and raises :class:`StartTimeout` naming the ranks and their
       workers; the ranks waiting for ``go`` fail at once. So does a task
       that ended (failed) before every rank had started.

    Two runs that start at once on the same workers could each start some
    of their ranks and wait for the rest, whose threads the other run
    holds: neither would start. So ``run`` holds a lock per worker of its
    ranks (a ``distributed.Lock`` named after the worker's address) from
    before it submits until ``go``. It takes them in address order, so two
    runs never wait for each other, and the wait counts against
    ``start_timeout``. A run that follows one holding its workers queues
    its tasks behind that run's; runs on disjoint workers start at once.
    The locks are leases that lapse if the process holding them dies.

    Then every rank calls ``plait.init`` with a store over the run's branch
    of the scheduler's metadata (:mod:`plait.dask._store`), with keys that
    no other run shares: the branch is named after the run's rank-0 task,
    whose key holds a fresh random job id.

Note [a failed rank]
    A rank whose ``fn`` raises closes its communicator, so that its peers'
    calls in progress or next fail with a plait error (``PeerLostError``)
    within seconds instead of waiting for it. ``run`` waits for the other
    ranks for at most :data:`FAILURE_GRACE` seconds more, then cancels
    those still running (a thread cannot be stopped: one stuck outside
    plait runs on until it returns), and raises :class:`GangError` naming
    the rank that failed first, preferring one whose error is not a
    consequence of another's (a ``PeerLostError``), with its exception as
    the cause. A worker that leaves the cluster while its rank runs (killed,
    out of memory) counts as that rank failing of its own accord, although
    its peers usually see its loss first: ``run`` checks every
    :data:`WATCHDOG` seconds.
"""

from __future__ import annotations

import contextlib
import importlib
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import plait
from plait._checks import check_timeout
from plait._init import TRANSPORTS
from plait.dask._store import SECRET_LOCK, DaskKeyValue, adopt_secret, ensure_secret
from plait.errors import AbortedError, ClosedError, PeerLostError
from plait.rendezvous.kv_store import KVStore, poll_until
from plait.rendezvous.store import StoreTimeout

__all__ = [
    "DEFAULT_START_TIMEOUT",
    "FAILURE_GRACE",
    "WATCHDOG",
    "GangError",
    "StartTimeout",
    "rank_order",
    "run",
]

#: Seconds for every rank's task to start (see Note [a gang of Dask tasks]).
DEFAULT_START_TIMEOUT = 60.0
#: Seconds ``run`` waits for the other ranks once one has failed (Note [a failed rank]).
FAILURE_GRACE = 10.0
#: Seconds between two checks that the running ranks' workers are still in the cluster.
WATCHDOG = 2.0
#: Errors a rank raises because another rank failed (used to blame the first cause).
_CONSEQUENCES = (PeerLostError, AbortedError, ClosedError)
_MISSING_DASK = "plait.dask needs Dask's distributed scheduler: pip install 'plait[dask]'"


class StartTimeout(StoreTimeout):
    """Some ranks did not start in time: their workers were busy, paused or gone.

    Attributes:
        missing: rank -> worker address of the ranks that did not start.
    """

    def __init__(self, message: str, missing: dict[int, str]) -> None:
        super().__init__(message)
        self.missing = missing


class GangError(RuntimeError):
    """A rank of :func:`run` failed; the exception's cause is that rank's exception.

    Attributes:
        rank, worker: the rank blamed (the first that failed, not one that
            failed because of another) and its worker's address.
        exception: that rank's exception.
        failures: rank -> exception, for every rank that failed.
        running: ranks still running when ``run`` gave up on them.
    """

    def __init__(
        self,
        message: str,
        rank: int,
        worker: str,
        failures: dict[int, BaseException],
        running: list[int],
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.worker = worker
        self.exception = failures[rank]
        self.failures = failures
        self.running = running


@dataclass(frozen=True)
class _Job:
    """What every rank's task is given besides ``fn`` and its arguments."""

    job: str
    root: str  # the rank-0 task's key: the metadata branch of the run
    workers: tuple[str, ...]  # rank -> worker address
    timeout: float | None
    start_timeout: float
    transport: str | None

    @property
    def size(self) -> int:
        return len(self.workers)


def _distributed() -> Any:
    # By name: mypy's result must not depend on whether Dask is installed.
    try:
        return importlib.import_module("distributed")
    except ImportError as exc:
        raise ImportError(_MISSING_DASK) from exc


def _name_key(name: object) -> tuple[int, int, str]:
    """Worker names in order: integers by value, then everything else as text."""
    if isinstance(name, int) and not isinstance(name, bool):
        return (0, name, "")
    return (1, 0, str(name))


def rank_order(client: Any, workers: Sequence[str] | None = None) -> list[str]:
    """The worker addresses of :func:`run`'s ranks, in rank order.

    With ``workers`` (addresses or worker names, each naming one worker),
    rank r is ``workers[r]``. Without, every worker of the cluster takes
    part, grouped by host (hosts in sorted order, so that ranks on one host
    are consecutive) and, within a host, by worker name (integers by value,
    as ``LocalCluster`` names them 0, 1, …, then other names as text), then
    address: a ``LocalCluster``'s worker ``i`` is rank ``i``.

    Raises:
        ValueError: a name or address matches no worker, or two entries the
            same worker; or the cluster has no workers.
    """
    info: dict[str, dict[str, Any]] = dict(client.scheduler_info(n_workers=-1)["workers"])
    if workers is None:
        if not info:
            raise ValueError("plait.dask.run: the Dask cluster has no workers")

        def order(address: str) -> tuple[str, tuple[int, int, str], str]:
            w = info[address]
            return (str(w.get("host", "")), _name_key(w.get("name")), address)

        return sorted(info, key=order)
    if isinstance(workers, str):
        raise TypeError("plait.dask.run: workers= is a list of worker addresses or names")
    by_name = {str(w.get("name")): address for address, w in info.items()}
    chosen: list[str] = []
    for entry in workers:
        address = entry if entry in info else by_name.get(str(entry))
        if address is None:
            known = ", ".join(f"{w.get('name')!s} ({a})" for a, w in sorted(info.items()))
            raise ValueError(
                f"plait.dask.run: {entry!r} is no worker of the cluster; workers: {known}"
            )
        if address in chosen:
            raise ValueError(f"plait.dask.run: {entry!r} names worker {address} a second time")
        chosen.append(address)
    if not chosen:
        raise ValueError("plait.dask.run: workers= is empty")
    return chosen


def _scheduler_host(address: str) -> str | None:
    """The host of the scheduler's address (the TCP transport listens where it reaches it)."""
    scheme, _, rest = address.rpartition("://")
    if scheme not in ("tcp", "tls", "") or not rest:
        return None  # inproc:// (a cluster in one process), ucx://, ws://: plait chooses
    host = rest.rpartition(":")[0] if ":" in rest else rest
    return host.strip("[]") or None


def _rank_main(fn: Callable[..., Any], job: _Job, rank: int, args: Any, kwargs: Any) -> Any:
    """One rank's task: meet the others, make the communicator, run ``fn``, close."""
    distributed = _distributed()
    worker = distributed.get_worker()
    client = distributed.get_client()
    adopt_secret(client)
    store = KVStore(
        DaskKeyValue(client, job.root),
        timeout=job.start_timeout,
        host=_scheduler_host(str(worker.scheduler.address)),
    )
    store.set(f"started/{rank}", str(worker.address).encode())
    try:
        go = store.get("go", job.start_timeout)
    except StoreTimeout:
        raise StartTimeout(
            f"plait.dask.run: rank {rank} of {job.size} (worker {worker.address}): the run did "
            f"not start within {job.start_timeout:g} s (the caller of run gave up or died)",
            {},
        ) from None
    if go != b"go":
        raise StartTimeout(
            f"plait.dask.run: rank {rank} of {job.size} (worker {worker.address}): the run was "
            f"abandoned: {go.decode(errors='replace')}",
            {},
        )
    comm = plait.init(
        rank=rank, size=job.size, store=store, timeout=job.timeout, transport=job.transport
    )
    try:
        return fn(comm, *args, **kwargs)
    finally:
        comm.close()  # Note [a failed rank]: the peers fail now, not at their timeouts


def _check_client(client: Any) -> None:
    for attr in ("submit", "scheduler_info", "get_metadata", "set_metadata"):
        if not hasattr(client, attr):
            raise TypeError(
                f"plait.dask.run: expected a distributed.Client, got {type(client).__name__}"
            )
    if getattr(client, "asynchronous", False):
        raise TypeError(
            "plait.dask.run blocks: call it with a synchronous Client (or from a thread, "
            "e.g. await loop.run_in_executor(None, plait.dask.run, sync_client, fn))"
        )


def run(
    client: Any,
    fn: Callable[..., Any],
    /,
    *args: Any,
    workers: Sequence[str] | None = None,
    timeout: float | None = None,
    start_timeout: float = DEFAULT_START_TIMEOUT,
    transport: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on every worker at once; their results in rank order.

    Each worker runs one rank, as a task pinned to it; ``comm`` is a
    :class:`plait.Communicator` among the ranks, who meet through the Dask
    scheduler (no other server). Rank r runs on ``rank_order(client,
    workers)[r]``. ``fn``, ``args`` and ``kwargs`` travel as a task's do
    (cloudpickle); futures among the arguments are replaced by their
    results, as in ``Client.submit``. The keyword arguments of ``run``
    itself are not passed on; ``client`` and ``fn`` are positional-only, so
    keywords of those names go on to ``fn``.

    Args:
        client: a synchronous ``distributed.Client``.
        fn: called as ``fn(comm, *args, **kwargs)`` in every rank.
        workers: the workers to run on (addresses or names), in rank order;
            default: every worker (see :func:`rank_order`).
        timeout: the communicator's default seconds per call
            (``plait.init``'s ``timeout``; PLAIT_TIMEOUT, else 300).
        start_timeout: seconds for every rank's task to start (it waits for
            a free thread on its worker) and meet the others.
        transport: ``plait.init``'s ``transport``: ``"auto"`` (default:
            shared memory within a host, TCP across hosts), ``"shm"``,
            ``"tcp"`` or ``"hybrid"``.

    Returns:
        ``fn``'s result on each rank, in rank order.

    Raises:
        GangError: a rank's ``fn`` (or its setup) raised, or its worker left
            the cluster; it names the rank and the worker, and its cause is
            that rank's exception.
        StartTimeout: some ranks did not start within ``start_timeout``
            (their workers are busy with other tasks, paused or gone).
        ValueError: ``workers`` names no worker, or the same one twice; a
            ``timeout`` or ``start_timeout`` that is not a positive number of
            seconds; a ``transport`` that ``plait.init`` does not know.
        TypeError: ``client`` or ``fn`` is not what it must be, or a keyword
            argument of ``run`` has the wrong type.

    Every argument is checked here, before any lock is taken or task
    submitted: a bad one would otherwise fail every rank on its worker.
    """
    distributed = _distributed()
    _check_client(client)
    if not callable(fn):
        raise TypeError(f"plait.dask.run: fn must be callable, got {type(fn).__name__}")
    seconds, start_seconds, kind = _check_keywords(timeout, start_timeout, transport)
    order = rank_order(client, workers)
    job_id = secrets.token_hex(8)
    keys = [f"plait-dask-{job_id}-{r}" for r in range(len(order))]
    job = _Job(job_id, keys[0], tuple(order), seconds, start_seconds, kind)
    ensure_secret(client, _SecretLock(distributed, client, job.start_timeout))
    store = KVStore(DaskKeyValue(client, job.root), timeout=job.start_timeout)
    deadline = time.monotonic() + job.start_timeout
    locks = _lock_workers(distributed, client, job, deadline)
    futures: list[Any] = []
    try:
        futures = [
            client.submit(
                _rank_main,
                fn,
                job,
                r,
                args,
                kwargs,
                key=keys[r],
                workers=[address],
                allow_other_workers=False,
                pure=False,
                retries=0,
            )
            for r, address in enumerate(order)
        ]
        _start(store, job, futures, client, deadline)
        _unlock(client, locks)
        return _finish(distributed, client, job, futures)
    finally:
        _unlock(client, locks)
        with contextlib.suppress(Exception):
            store.kv.delete("", by_prefix=True)  # the run's branch; its task takes the rest
        with contextlib.suppress(Exception):
            client.cancel([f for f in futures if not f.done()])


def _check_keywords(
    timeout: Any, start_timeout: Any, transport: Any
) -> tuple[float | None, float, str | None]:
    """``run``'s keyword arguments checked as ``plait.init`` checks them, on the caller's side.

    The ranks' ``plait.init`` would refuse a bad ``timeout`` or ``transport``
    too, but only once every task holds its worker, with a traceback per
    worker; a NaN ``start_timeout`` would fail inside Dask. A transport object
    cannot travel to the workers, so ``transport`` is a name (or None: each
    worker's PLAIT_TRANSPORT, else ``"auto"``).
    """
    where = "plait.dask.run"
    seconds = None if timeout is None else check_timeout(timeout, where)
    start_seconds = check_timeout(start_timeout, f"{where}: start_timeout")
    if transport is None:
        return seconds, start_seconds, None
    if not isinstance(transport, str):
        raise TypeError(
            f"{where}: transport must be one of {', '.join(TRANSPORTS)} (a name: a transport "
            f"object cannot travel to the workers); got {type(transport).__name__}"
        )
    if transport.lower() not in TRANSPORTS:
        raise ValueError(
            f"{where}: unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}"
        )
    return seconds, start_seconds, transport


def _lock_workers(distributed: Any, client: Any, job: _Job, deadline: float) -> list[Any]:
    """Hold every worker of the run's start lock, in address order, by ``deadline``; else
    raise :class:`StartTimeout` (Note [a gang of Dask tasks])."""
    held: list[Any] = []
    for address in sorted(job.workers):
        lock = distributed.Lock(
            f"plait-dask-start-{address}", scheduler_rpc=client.scheduler, loop=client.loop
        )
        if lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            held.append(lock)
            continue
        _unlock(client, held)
        _stop_refresh(client, lock)
        rank = job.workers.index(address)
        message = (
            f"plait.dask.run: rank {rank} on {address} did not start: another plait.dask.run "
            f"was still starting on that worker (waited {job.start_timeout:g} s)"
        )
        raise StartTimeout(message, {rank: address})
    return held


class _SecretLock:
    """The cluster's lock for publishing the secret (Note [the cluster's secret] in
    :mod:`plait.dask._store`); made and taken only when entered.

    Not taken within ``seconds`` (or the scheduler refused it), the run goes on
    without it: a publish that then loses a race is logged by the scheduler, and
    does no harm.
    """

    def __init__(self, distributed: Any, client: Any, seconds: float) -> None:
        self.distributed = distributed
        self.client = client
        self.seconds = seconds
        self.held: list[Any] = []

    def __enter__(self) -> None:
        lock = self.distributed.Lock(
            SECRET_LOCK, scheduler_rpc=self.client.scheduler, loop=self.client.loop
        )
        try:
            taken = lock.acquire(timeout=self.seconds)
        except Exception:  # the publish that follows says what is wrong, if anything
            taken = False
        if taken:
            self.held.append(lock)
        else:
            _stop_refresh(self.client, lock)

    def __exit__(self, *exc: object) -> None:
        _unlock(self.client, self.held)


def _unlock(client: Any, locks: list[Any]) -> None:
    """Release the start locks still held; each lock's lease refresh stops with it."""
    while locks:
        lock = locks.pop()
        with contextlib.suppress(Exception):
            lock.release()
        _stop_refresh(client, lock)


def _stop_refresh(client: Any, lock: Any) -> None:
    """Stop a lock's periodic lease refresh, which would otherwise outlive the lock."""
    refresh = getattr(lock, "refresh_callback", None)
    if refresh is not None:
        with contextlib.suppress(Exception):
            client.loop.add_callback(refresh.stop)


def _start(store: KVStore, job: _Job, futures: list[Any], client: Any, deadline: float) -> None:
    """Wait until every rank has started, then say go; else say why not (Note [a gang of Dask
    tasks]). A task that ended early is left to ``_finish`` to report."""
    kv = store.kv
    started: set[int] = set()
    present = set(job.workers)
    checked = time.monotonic()

    def ready() -> bool:
        nonlocal present, checked
        started.update(int(k.removeprefix("started/")) for k in kv.keys("started/"))
        if len(started) == job.size or any(f.done() for f in futures):
            return True
        if time.monotonic() - checked >= WATCHDOG:  # a worker that left fails the start now
            checked = time.monotonic()
            present = set(client.scheduler_info(n_workers=-1)["workers"])
        return any(job.workers[r] not in present for r in range(job.size) if r not in started)

    poll_until(ready, deadline)
    if len(started) == job.size:
        store.set("go", b"go")
        return
    if any(f.done() for f in futures):
        store.set("go", b"a rank failed before every rank had started")
        return
    missing = {r: job.workers[r] for r in range(job.size) if r not in started}
    present = set(client.scheduler_info(n_workers=-1)["workers"])
    busy = "busy: every thread of the worker runs another task, or it is paused"
    gone = "gone: the worker left the cluster"
    why = "; ".join(
        f"rank {r} on {w} ({busy if w in present else gone})" for r, w in missing.items()
    )
    message = f"plait.dask.run: {len(missing)} of {job.size} ranks did not start: {why}"
    if all(w in present for w in missing.values()):
        message += f" (waited {job.start_timeout:g} s)"
    store.set("go", message.encode())
    raise StartTimeout(message, missing)


def _finish(distributed: Any, client: Any, job: _Job, futures: list[Any]) -> list[Any]:
    """Wait for every rank; the results, or GangError after a failure (Note [a failed rank])."""
    pending = dict(enumerate(futures))
    failures: dict[int, BaseException] = {}
    order: list[int] = []  # ranks in the order their failures were seen
    left: set[int] = set()  # ranks whose worker left: a cause, though a PeerLostError
    give_up: float | None = None
    while pending:
        now = time.monotonic()
        if give_up is not None and now >= give_up:
            break
        wait = WATCHDOG if give_up is None else min(WATCHDOG, give_up - now)
        # Raises on a timeout, or when a task was cancelled: the statuses below tell which.
        with contextlib.suppress(Exception):
            distributed.wait(list(pending.values()), timeout=wait, return_when="FIRST_COMPLETED")
        for r, f in list(pending.items()):
            if f.done():
                del pending[r]
                if f.status != "finished":
                    failures[r] = _exception(f)
                    order.append(r)
        if pending:
            present = set(client.scheduler_info(n_workers=-1)["workers"])
            for r in [r for r in pending if job.workers[r] not in present]:
                del pending[r]
                failures[r] = PeerLostError(
                    f"worker {job.workers[r]} left the Dask cluster while rank {r} ran"
                )
                order.append(r)
                left.add(r)
        if failures and give_up is None:
            give_up = time.monotonic() + FAILURE_GRACE
    if not failures:
        return list(client.gather(futures))
    raise _gang_error(job, failures, order, sorted(pending), left)


def _exception(future: Any) -> BaseException:
    """A finished task's exception (a cancelled one's too)."""
    if future.status == "cancelled":
        return RuntimeError("the task was cancelled")
    try:
        exc = future.exception()
    except BaseException as err:  # the exception itself could not be fetched or unpickled
        return err
    return exc if isinstance(exc, BaseException) else RuntimeError(repr(exc))


def _gang_error(
    job: _Job,
    failures: dict[int, BaseException],
    order: list[int],
    running: list[int],
    left: set[int],
) -> GangError:
    """The error naming the rank that failed first of those that failed of their own accord
    (an exception not caused by another rank's loss, or a worker that left), else the first."""
    causes = [r for r in order if r in left or not isinstance(failures[r], _CONSEQUENCES)]
    rank = causes[0] if causes else order[0]
    exc = failures[rank]
    lines = [
        f"plait.dask.run: rank {rank} of {job.size} (worker {job.workers[rank]}) failed: "
        f"{type(exc).__name__}: {exc}"
    ]
    for r in order:
        if r != rank:
            other = failures[r]
            text = str(other).splitlines()[0] if str(other) else ""
            lines.append(f"  then rank {r} ({job.workers[r]}): {type(other).__name__}: {text}")
    if running:
        lines.append(
            f"  still running after {FAILURE_GRACE:g} s, cancelled: ranks {running} "
            f"({', '.join(job.workers[r] for r in running)})"
        )
    error = GangError("\n".join(lines), rank, job.workers[rank], failures, running)
    error.__cause__ = exc
    return error
