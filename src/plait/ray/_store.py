"""A plait Store kept in Ray's internal key-value store (the GCS), so no server is started.

The Store itself, :class:`~plait.rendezvous.kv_store.KVStore`, is shared with
plait.dask; this module adds Ray's key-value store under it.

Note [waiting on Ray's key-value store]
    Ray's internal key-value store (``ray.experimental.internal_kv``, kept by
    the cluster's GCS) offers get, put (with put-if-absent), exists, delete
    (by prefix too) and a key listing, but no way to block until a key
    appears, so waiting polls with a back-off from 1 ms to 50 ms (Note
    [waiting on a store without blocking reads] in
    :mod:`plait.rendezvous.kv_store`). Ray's own gloo group meets the same
    way. Waiting happens only while a group is created: once the ranks are
    connected the store is not used.

Note [adding without compare-and-swap]
    The key-value store has no atomic increment, but its put-if-absent is
    atomic, and ``add`` is built on it: see the Note of that name in
    :mod:`plait.rendezvous.kv_store`.
"""

from __future__ import annotations

from typing import Any

from plait.errors import RendezvousError
from plait.rendezvous.kv_store import KeyValue, KVStore, poll_until

__all__ = ["KeyValue", "RayKVStore", "RayKeyValue", "poll_until"]


class RayKeyValue:
    """Ray's internal key-value store, in one namespace.

    Needs a connected Ray (a driver after ``ray.init``, or any actor or task).

    Args:
        namespace: keys of different namespaces never meet.
    """

    def __init__(self, namespace: str) -> None:
        import ray.experimental.internal_kv as kv

        if not kv._internal_kv_initialized():
            raise RendezvousError(
                "Ray's key-value store is not reachable: call ray.init() first, "
                "or create the group inside a Ray actor or task"
            )
        self._kv: Any = kv
        self.namespace = namespace

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None."""
        value = self._kv._internal_kv_get(key, namespace=self.namespace)
        return None if value is None else bytes(value)

    def put(self, key: str, value: bytes, overwrite: bool) -> bool:
        """Store ``value``; whether the key existed before."""
        return bool(
            self._kv._internal_kv_put(key, bytes(value), overwrite, namespace=self.namespace)
        )

    def exists(self, key: str) -> bool:
        """Whether ``key`` is set."""
        return bool(self._kv._internal_kv_exists(key, namespace=self.namespace))

    def delete(self, key: str, by_prefix: bool = False) -> int:
        """Remove ``key`` (or all keys starting with it)."""
        return int(
            self._kv._internal_kv_del(key, del_by_prefix=by_prefix, namespace=self.namespace)
        )

    def keys(self, prefix: str) -> list[str]:
        """The keys starting with ``prefix``."""
        found = self._kv._internal_kv_list(prefix, namespace=self.namespace)
        keys = [k.decode() if isinstance(k, bytes) else str(k) for k in found]
        # Ray lists a key of namespace "a:b" as "b:<key>" (it cuts at the namespace's
        # first colon): cut that part away too.
        rest = self.namespace.partition(":")[2]
        return [k.removeprefix(rest + ":") if rest else k for k in keys]


class RayKVStore(KVStore):
    """A plait :class:`~plait.rendezvous.store.Store` over Ray's key-value store (or a fake).

    A :class:`~plait.rendezvous.kv_store.KVStore` with the Ray group's
    arguments: ``kv`` is one namespace per group, ``prefix`` one per
    incarnation of the group (Note [one incarnation of a Ray group] in
    :mod:`plait.ray._rendezvous`), ``host`` the GCS's host.
    """
