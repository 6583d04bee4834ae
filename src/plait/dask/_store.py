"""The keys of one plait.dask run, kept in the Dask scheduler's metadata; the cluster's secret.

Note [a run's keys in the scheduler's metadata]
    A Dask scheduler keeps a tree of small values for its clients
    (``Client.set_metadata``/``get_metadata``, msgpack values), and forgets
    the branch named after a task's key when it forgets the task. A run's
    ranks meet under the branch named after the key of its rank-0 task:
    ``[<rank-0 key>, "plait", <key>]``. So whatever a run leaves there,
    even when the process that called ``run`` dies, goes with the task;
    ``run`` also empties the branch itself when it ends. The tree has no
    delete: a deleted key holds None, which reads as unset. It has no
    blocking read either, so waiting polls with a back-off
    (:mod:`plait.rendezvous.kv_store`), and only while the ranks meet.

Note [one writer per key]
    The metadata tree has no compare-and-swap, so ``put`` with
    ``overwrite=False`` checks and then writes, under a lock of the
    process. That is a true put-if-absent for the threads of one process
    and, across processes, for keys that one rank alone writes. Every key
    of a run is such a key: plait.init's ``host/<r>``, the transports'
    ``addr/<r>`` and ``ready/<r>`` and the shared-memory generation counter
    (``add``, :mod:`plait.rendezvous.kv_store`) are written by rank r only;
    ``started/<r>`` by rank r; ``go`` by the process that called ``run``.

Note [the cluster's secret]
    plait authenticates its TCP connections with PLAIT_SECRET
    (:mod:`plait._auth`). A rank whose process has none takes the
    cluster's, which the first ``run`` on the cluster draws and publishes
    as the Dask dataset ``plait-secret``, so every process reads the same
    secret. ``Client.publish_dataset`` with ``override=False`` is a
    put-if-absent, but the one that loses a race fails in the scheduler,
    which logs the failure (a traceback at ERROR) before it answers; so a
    ``run`` that finds no secret publishes it holding the Dask lock
    ``plait-secret`` and only if it is still not there. The lock is only
    taken while the cluster has no secret. The secret lives as long as the
    scheduler. A process given PLAIT_SECRET (a worker started with it in
    its environment) keeps its own: give every worker the same one.
    Whoever can reach the scheduler can read the secret, but can also run
    code on every worker.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import MutableMapping
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["SECRET_DATASET", "SECRET_LOCK", "DaskKeyValue", "adopt_secret", "ensure_secret"]

#: The Dask dataset that holds the cluster's secret (Note [the cluster's secret]).
SECRET_DATASET = "plait-secret"
#: The Dask lock under which a run publishes the secret (Note [the cluster's secret]).
SECRET_LOCK = "plait-secret"
#: Under a run's branch of the metadata tree, plait's keys sit in this entry.
_ENTRY = "plait"
#: Serialises put-if-absent among the threads of a process (Note [one writer per key]).
_PUT_LOCK = threading.Lock()


class DaskKeyValue:
    """A :class:`~plait.rendezvous.kv_store.KeyValue` in one branch of a Dask scheduler's metadata.

    See Note [a run's keys in the scheduler's metadata] and Note [one
    writer per key].

    Args:
        client: a connected ``distributed.Client`` (in a task: the worker's).
        root: the branch, the key of the run's rank-0 task.
    """

    def __init__(self, client: Any, root: str) -> None:
        self.client = client
        self.root = root

    def __repr__(self) -> str:
        return f"DaskKeyValue(root={self.root!r})"

    def _table(self) -> dict[str, Any]:
        table = self.client.get_metadata([self.root, _ENTRY], None)
        return table if isinstance(table, dict) else {}

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None."""
        value = self.client.get_metadata([self.root, _ENTRY, key], None)
        return None if value is None else bytes(value)

    def put(self, key: str, value: bytes, overwrite: bool) -> bool:
        """Store ``value`` (if ``overwrite`` or the key is unset); whether the key existed."""
        with _PUT_LOCK:
            existed = self.exists(key)
            if overwrite or not existed:
                self.client.set_metadata([self.root, _ENTRY, key], bytes(value))
            return existed

    def exists(self, key: str) -> bool:
        """Whether ``key`` is set."""
        return self.get(key) is not None

    def delete(self, key: str, by_prefix: bool = False) -> int:
        """Remove ``key`` (or every key starting with it); how many were removed."""
        if by_prefix and not key:
            gone = sum(v is not None for v in self._table().values())
            self.client.set_metadata([self.root, _ENTRY], {})
            return gone
        names = self.keys(key) if by_prefix else [key] if self.exists(key) else []
        for name in names:
            self.client.set_metadata([self.root, _ENTRY, name], None)
        return len(names)

    def keys(self, prefix: str) -> list[str]:
        """The keys starting with ``prefix`` (one round trip)."""
        return [
            k
            for k, v in self._table().items()
            if v is not None and isinstance(k, str) and k.startswith(prefix)
        ]


def ensure_secret(client: Any, lock: AbstractContextManager[Any] | None = None) -> None:
    """Publish the cluster's secret unless it is there (Note [the cluster's secret]).

    Checks with ``list_datasets``: ``get_dataset`` would also tell the
    scheduler again about every future the client holds, cancelled ones too.
    Where it is not there, checks again and publishes under ``lock`` (the
    cluster's lock :data:`SECRET_LOCK`, held by ``run``): a publish that loses
    a race fails in the scheduler, which logs it as an error.
    """
    if SECRET_DATASET in client.list_datasets():
        return
    with contextlib.nullcontext() if lock is None else lock:
        if SECRET_DATASET in client.list_datasets():
            return
        # KeyError: a publisher that took no lock came first, and that one is the secret.
        with contextlib.suppress(KeyError):
            client.publish_dataset(secrets.token_hex(32), name=SECRET_DATASET, override=False)


def adopt_secret(client: Any, environ: MutableMapping[str, str] | None = None) -> str:
    """Make sure this process has PLAIT_SECRET: its own, else the cluster's; returns it.

    Raises:
        RuntimeError: the cluster has no secret (``ensure_secret`` was not called).
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    own = env.get("PLAIT_SECRET", "")
    if own:
        return own
    stored = client.get_dataset(SECRET_DATASET, default=None)
    if not isinstance(stored, str) or not stored:
        raise RuntimeError(f"the Dask cluster has no plait secret (dataset {SECRET_DATASET!r})")
    env.setdefault("PLAIT_SECRET", stored)
    return env["PLAIT_SECRET"]
