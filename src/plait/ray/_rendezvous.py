"""How the members of a Ray collective group find each other, with nothing stale.

Note [one incarnation of a Ray group]
    Ray names groups, and a name is reused: a group is destroyed (after a
    member died, say) and created again under the same name, maybe with
    fresh actors. Whatever the first incarnation left in the key-value store
    (addresses of dead processes, counters) must never reach the second. So
    each incarnation meets under a fresh random token, and only rank 0 makes
    it; the other ranks learn it from rank 0 in a way that cannot be stale:

    1. Rank r > 0 draws a fresh nonce, writes ``arrive/<nonce>`` and waits
       for ``ack/<nonce>``, which holds the token.
    2. Rank 0 draws the token and, until every rank has joined it (while
       ``plait.init`` waits for them), answers every ``arrive/<nonce>`` it
       finds with ``ack/<nonce>``.
    3. Every rank runs ``plait.init`` on a store whose keys all start with
       ``run/<token>/``; rank 0 then deletes the arrivals it answered (every
       live rank read its answer before joining) and, when the group is
       destroyed, everything under ``run/<token>/``.

    A nonce is new, so its answer comes from a rank 0 that is creating the
    group now; a token is new, so nothing under it predates the incarnation.
    Arrivals left by processes that died waiting are answered by the next
    rank 0 and deleted with the rest. All of this lives in the namespace
    ``plait/<job id>/<group name>`` of Ray's internal key-value store.

Note [the job's secret]
    plait authenticates its TCP connections with PLAIT_SECRET
    (:mod:`plait._auth`). Where a process has none, the first member of any
    plait group of the Ray job draws one and keeps it in Ray's key-value
    store (namespace ``plait/<job id>``, key ``secret``, put-if-absent, so
    every process reads the same), and each process sets PLAIT_SECRET to it.
    A process given PLAIT_SECRET (``runtime_env={"env_vars": ...}``) keeps
    its own: give every member the same one. Whoever can reach the GCS can
    read the secret, but can also run code in the cluster.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, MutableMapping

from plait.errors import RendezvousError
from plait.ray._store import KeyValue, RayKVStore, poll_until
from plait.rendezvous.store import StoreTimeout

__all__ = ["Meeting", "adopt_secret", "group_namespace", "job_namespace", "meet"]


def job_namespace(job_id: str) -> str:
    """The key-value namespace of plait's job-wide keys (the secret)."""
    return f"plait/{job_id}"


def group_namespace(job_id: str, group_name: str) -> str:
    """The key-value namespace of one Ray group (Note [one incarnation of a Ray group])."""
    return f"plait/{job_id}/{group_name}"


def adopt_secret(kv: KeyValue, environ: MutableMapping[str, str] | None = None) -> str:
    """Make sure this process has the job's PLAIT_SECRET; returns it (Note [the job's secret])."""
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    own = env.get("PLAIT_SECRET", "")
    if own:
        return own
    kv.put("secret", secrets.token_hex(32).encode(), False)
    stored = kv.get("secret")
    if not stored:
        raise RendezvousError("Ray's key-value store lost plait's job secret just after it was set")
    env["PLAIT_SECRET"] = stored.decode()
    return env["PLAIT_SECRET"]


class Meeting:
    """One rank's part in creating one incarnation of a group.

    Attributes:
        store: the store ``plait.init`` meets through (prefix ``run/<token>/``).
        token: the incarnation's token.
    """

    def __init__(self, kv: KeyValue, store: RayKVStore, token: str, rank: int) -> None:
        self.kv = kv
        self.store = store
        self.token = token
        self.rank = rank
        self._answered: set[str] = set()

    def answer(self) -> None:
        """Rank 0: answer every arrival not answered yet with the token."""
        for key in self.kv.keys("arrive/"):
            nonce = key.removeprefix("arrive/")
            if nonce not in self._answered:
                self.kv.put(f"ack/{nonce}", self.token.encode(), True)
                self._answered.add(nonce)

    def joined(self) -> None:
        """``plait.init`` returned (or failed): stop answering, delete what was answered."""
        self.store.on_poll = None
        for nonce in self._answered:
            with contextlib.suppress(Exception):
                self.kv.delete(f"arrive/{nonce}")
                self.kv.delete(f"ack/{nonce}")
        self._answered.clear()

    def forget(self) -> None:
        """The group is destroyed: rank 0 deletes the incarnation's keys."""
        if self.rank == 0:
            with contextlib.suppress(Exception):
                self.store.clear()


def meet(
    kv: KeyValue,
    rank: int,
    size: int,
    group_name: str,
    timeout: float,
    *,
    host: str | None = None,
    token: Callable[[], str] = lambda: secrets.token_hex(16),
) -> Meeting:
    """Find this incarnation's token (Note [one incarnation of a Ray group]).

    Rank 0 returns at once (it answers the others while ``plait.init`` waits);
    another rank returns once rank 0 has answered its arrival.

    Raises:
        StoreTimeout: rank 0 did not answer within ``timeout`` seconds.
    """
    if rank == 0:
        run = token()
        store = RayKVStore(kv, f"run/{run}/", timeout=timeout, host=host)
        meeting = Meeting(kv, store, run, rank)
        store.on_poll = meeting.answer
        meeting.answer()
        return meeting
    nonce = token()
    kv.put(f"arrive/{nonce}", str(rank).encode(), True)
    found: list[bytes] = []

    def answered() -> bool:
        value = kv.get(f"ack/{nonce}")
        if value is not None:
            found.append(value)
        return value is not None

    if not poll_until(answered, time.monotonic() + timeout):
        with contextlib.suppress(Exception):
            kv.delete(f"arrive/{nonce}")
        raise StoreTimeout(
            f"Ray group {group_name!r}: rank {rank} of {size}: rank 0 did not create the group "
            f"within {timeout:g} s (not started, failed, or given another group name)"
        )
    run = found[0].decode()
    store = RayKVStore(kv, f"run/{run}/", timeout=timeout, host=host)
    return Meeting(kv, store, run, rank)
