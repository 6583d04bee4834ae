"""Rendezvous: plait's ranks meet through torch's store, whatever created it.

Note [which store the plait backend uses]
    ``init_process_group`` hands every backend a store (torch's TCPStore under
    ``env://`` and torchrun, a FileStore for ``file://``, or whatever was
    passed as ``store=``), with a namespace of its own per process group. The
    plait backend rendezvouses through that store, wrapped as a plait
    :class:`~plait.rendezvous.store.Store` (:class:`TorchStore`), so every way
    torch has of starting a group works, sub-groups (``new_group``) included,
    and nothing else is opened: no second port beside torch's MASTER_PORT.

    ``plait run`` gives its ranks plait's variables (PLAIT_RANK, PLAIT_STORE,
    …) but not torch's (RANK, MASTER_ADDR, …), so torch's own ``env://``
    would fail there. ``import plait.torch`` therefore extends ``env://``
    (:func:`install_env_rendezvous`): when MASTER_ADDR is unset and PLAIT_RANK
    is set, rank 0 starts torch's TCPStore on a free port and announces its
    address through plait's store; every other case goes to torch's handler
    unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from plait._net import route_to
from plait.errors import RendezvousError
from plait.rendezvous.store import Store, StoreTimeout

__all__ = ["TorchStore", "install_env_rendezvous", "plait_run_rendezvous"]

#: plait.init's keys start with ``plait/init<n>/``, n counting the process's init calls.
_INIT_GENERATION = re.compile(r"^plait/init\d+/")
#: The counters of a namespace's groups, one per size (Note [a namespace used again]).
_GROUPS = "plait/groups"


class TorchStore(Store):
    """A torch.distributed ``Store`` seen through plait's Store contract.

    plait.init numbers its keys with the count of ``init`` calls made by this
    process; the members of a torch sub-group can have made different counts
    (only members create a group's backend), while torch already gives each
    group a namespace of its own. So the count is dropped from the keys, and
    replaced by the group's own (Note [a namespace used again]) where ``size``
    is given.

    Note [a namespace used again]
        ``destroy_process_group()`` resets torch's count of groups, so the next
        default group gets the old one's namespace (``default_pg/0/``) in a store
        that may outlive it: torchrun's, or one that a sub-group the program still
        holds keeps open. plait's keys of the old group were there, and the new
        group's ranks found their ranks claimed ("another process has already
        joined this job as rank 0"). gloo overwrites its keys and does not see it.
        So each member of a group adds 1 to a counter of the namespace as its
        backend is made, one counter per group size (a namespace may serve groups
        of different sizes, a sub-group's name being a count that starts again
        too), and ``(count - 1) // size`` numbers the group's keys, with its size:
        every member of one group has added before any member of the next one of
        that size can (the next is made after the last has met, which needs them
        all).

    Args:
        store: torch's store (usually the group's PrefixStore).
        timeout: default seconds of blocking calls.
        size: the group's size, to number its keys by the groups made in this
            namespace before it (None: not numbered).
    """

    def __init__(self, store: dist.Store, timeout: float, size: int | None = None) -> None:
        self._store = store
        self.timeout = timeout
        #: The store's host, for plait's TCP transport to pick the route to it.
        self.host = _host_of(store)
        self._prefix = "plait/init/"
        if size is not None:  # Note [a namespace used again]
            counter = f"{_GROUPS}/{size}"
            with _broken("add", [counter]):
                made = int(store.add(counter, 1))
            self._prefix = f"plait/init{size}-{(made - 1) // size}/"

    def _key(self, key: str) -> str:
        return _INIT_GENERATION.sub(self._prefix, key, count=1)

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""
        with _broken("set", [key]):
            # torch's stub says str; the binding takes bytes as well
            self._store.set(self._key(key), bytes(value))  # type: ignore[arg-type]

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until it is set."""
        self.wait([key], timeout)
        with _broken("get", [key]):
            return bytes(self._store.get(self._key(key)))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key``; the new value."""
        with _broken("add", [key]):
            return int(self._store.add(self._key(key), amount))

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until every key is set.

        Raises:
            StoreTimeout: keys still missing after ``timeout`` (they are named).
            RendezvousError: the store's connection broke (its host went away).
        """
        seconds = self._timeout(timeout)
        names = [self._key(k) for k in keys]
        with _broken("wait", keys):
            try:
                self._store.wait(names, timedelta(seconds=seconds))
            except RuntimeError as exc:  # torch's DistStoreError: a timeout, if not broken
                if _is_broken(exc):
                    raise
                missing = [k for k in keys if not self._store.check([self._key(k)])]
                raise StoreTimeout(
                    f"torch store: keys {missing} not set within {seconds} s ({exc})"
                ) from exc

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set."""
        with _broken("check", keys):
            return bool(self._store.check([self._key(k) for k in keys]))

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        with _broken("delete", [key]):
            return bool(self._store.delete_key(self._key(key)))


def _is_broken(exc: BaseException) -> bool:
    """Whether torch's store error ``exc`` says the connection broke, not a timeout."""
    network = getattr(dist, "DistNetworkError", None)
    return network is not None and isinstance(exc, network)


@contextlib.contextmanager
def _broken(what: str, keys: Sequence[str]) -> Iterator[None]:
    """Turn torch's error for a store connection that broke (``DistNetworkError``: "Failed
    to recv, got 0 bytes") into plait's RendezvousError, naming what was asked; a waiting
    call took it for a timeout, or it came out raw."""
    try:
        yield
    except RuntimeError as exc:
        if not _is_broken(exc):
            raise
        raise RendezvousError(
            f"torch store: the connection broke during {what} of {list(keys)}: its host (the "
            f"rank that serves it, rank 0 under env://) may have exited or died ({exc})"
        ) from exc


def _host_of(store: Any) -> str | None:
    """The host of a TCPStore under torch's PrefixStore wrappers, if it is one."""
    for _ in range(16):
        host = getattr(store, "host", None)
        if isinstance(store, dist.TCPStore) and isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


# -- env:// under plait run ------------------------------------------------------------

_env_calls = 0
_env_lock = threading.Lock()


def install_env_rendezvous() -> None:
    """Let torch's ``env://`` also work under ``plait run``; see the module's Note.

    torch refuses a second handler for a scheme, so the ``env`` entry of its
    handler table is replaced by one that passes through to the original
    unless MASTER_ADDR is unset and PLAIT_RANK is set. Idempotent.
    """
    # The module, not the function torch.distributed re-exports under the same name.
    module = importlib.import_module("torch.distributed.rendezvous")
    table = module._rendezvous_handlers
    current = table.get("env")
    if current is None or getattr(current, "_plait_wraps", None) is not None:
        return

    def env_handler(url: str, timeout: timedelta = default_pg_timeout, **kwargs: Any) -> Any:
        if _under_plait_run():
            return plait_run_rendezvous(url, timeout)
        return current(url, timeout=timeout, **kwargs)

    env_handler._plait_wraps = current  # type: ignore[attr-defined]
    table["env"] = env_handler


def _under_plait_run() -> bool:
    env = os.environ
    return not env.get("MASTER_ADDR", "").strip() and bool(env.get("PLAIT_RANK", "").strip())


def plait_run_rendezvous(
    url: str, timeout: timedelta = default_pg_timeout
) -> Iterator[tuple[dist.Store, int, int]]:
    """``env://`` under ``plait run``: torch's TCPStore, found through plait's store.

    Rank and size come from the URL's query (``init_process_group(rank=,
    world_size=)``), else RANK and WORLD_SIZE, else plait run's PLAIT_RANK and
    PLAIT_SIZE. Rank 0 starts a TCPStore on a free port of this host and puts
    its address in plait's store (PLAIT_STORE); the other ranks read it and
    connect. Every rank must call ``init_process_group`` as often as the
    others, as torch requires anyway: the n-th calls meet.
    """
    from plait._init import detect_launch
    from plait.rendezvous.url import store_from_url

    global _env_calls
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
    info = detect_launch()
    rank = int(query.get("rank") or os.environ.get("RANK") or info.rank)
    size = int(query.get("world_size") or os.environ.get("WORLD_SIZE") or info.size)
    if info.store_url is None:
        raise RendezvousError(
            f"rank {rank}: env:// under plait run needs PLAIT_STORE, which plait run sets"
        )
    with _env_lock:
        _env_calls += 1
        key = f"plait-torch/env/{_env_calls}/address"
    seconds = timeout.total_seconds()
    plait_store = store_from_url(info.store_url, rank=rank, timeout=seconds)
    try:
        if rank == 0:
            host = _local_address(plait_store)
            store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
            plait_store.set(key, json.dumps([host, store.port]).encode())
        else:
            host, port = json.loads(plait_store.get(key, seconds))
            store = dist.TCPStore(host, port, size, False, timeout=timeout)
    finally:
        with contextlib.suppress(Exception):
            plait_store.close()
    yield store, rank, size
    raise RuntimeError("env:// under plait run cannot rendezvous again")


def _local_address(plait_store: Store) -> str:
    """This host's address as the other ranks reach it: the route to plait's store."""
    host = getattr(plait_store, "host", None)
    if not isinstance(host, str) or not host:
        nodes = os.environ.get("PLAIT_NNODES", "1").strip() or "1"
        return "127.0.0.1" if nodes == "1" else socket.gethostname()
    return route_to(host)
