"""The launchers of a job on several hosts meet in its store before any of them starts a rank.

Note [launchers meet]
    ``plait run --nnodes N`` runs one launcher per host, each given its ``--node-rank`` K and
    its ``-n`` P; rank ``r`` of node K is the job's rank ``K * P + r`` of ``N * P``, and the
    ranks meet in the store that node 0's launcher serves. Two mistakes in how the
    launchers were started break that numbering, and no launcher can see them alone:

    - launchers given different ``-n`` (or ``--nnodes``) give their ranks different job
      sizes and overlapping numbers: a rank of one writes the keys of a rank of the other,
      and the ranks of the first wait out their timeout for ranks that never come;
    - two launchers given one ``--node-rank`` start two sets of ranks with the same
      numbers, which overwrite each other's keys.

    So every launcher meets the others (:func:`meet_nodes`) before it starts a rank, in
    the ``plait/nodes/`` keys at the store's root (each attempt of a job has a new store,
    and restarts are for one host, where nothing meets):

    1. It claims node K with ``add("plait/nodes/K/claims", 1)``. The store adds
       atomically, so one launcher gets 1 and holds node K, and only it sets
       ``plait/nodes/K`` (:func:`claim_key`): who it is (host, pid) and what it was given
       (``-n``, ``--nnodes``). A launcher that gets more reads the holder's claim, files
       why the job cannot start, naming both, and fails; it writes nothing else.
    2. It waits for every node's claim, in slices of :data:`LOOK_SECONDS`. After each
       slice it compares the claims it has read with node 0's (with its own while node
       0's is not there), and reads the notice of a launcher that failed. Claims that
       differ, such a notice, a signal to the launcher or the deadline end its meeting:
       it files why as the notice (the first launcher to fail files it; nothing is
       overwritten), so that launchers still waiting fail within a slice with the same
       reason, not at their own deadline. Every launcher reads the same claims, so
       launchers that disagree all name the same nodes.
    3. Node 0's launcher decides: once it has read every node's claim, all alike, and
       no notice, it sets ``plait/nodes/met``, and only then does any launcher start
       its ranks. So the launchers of a job all start it or all fail: a notice filed
       after that (a launcher late for a job already met) fails its filer alone.
    4. A holder that fails sets ``plait/nodes/K/done`` once it needs nothing more from
       the store. Node 0's launcher serves the store and closes it when it fails: it
       first waits, at most :data:`GRACE_SECONDS`, for the ``done`` of every other node
       claimed, so that they fail with the reason rather than with a store gone away.

    Ranks start only on launchers that have met every other with the same ``-n`` and
    ``--nnodes``, so no rank's key is ever written under a numbering that clashes with
    another's. A launcher given the node rank of a job already running fails at its
    claim and the job goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from plait.errors import RendezvousError
from plait.rendezvous.store import Store, StoreTimeout

__all__ = ["GRACE_SECONDS", "LOOK_SECONDS", "MeetingError", "NodeClaim", "claim_key", "meet_nodes"]

#: Seconds a launcher waits for the others' claims between two looks at the notice.
LOOK_SECONDS = 1.0
#: Seconds node 0's launcher, failing, waits for the others to have read why.
GRACE_SECONDS = 5.0

_PREFIX = "plait/nodes"
#: Why a launcher failed to meet the others, filed by the first to fail.
_NOTICE = f"{_PREFIX}/failed"
_NOTICE_COUNT = f"{_PREFIX}/failed/count"
#: Set by node 0's launcher once every node's has come, alike: the job's ranks may start.
_MET = f"{_PREFIX}/met"


class MeetingError(RendezvousError):
    """The launchers of a job cannot start it: the message says why, naming them."""


def claim_key(node: int) -> str:
    """The key that holds the claim of node ``node``'s launcher (Note [launchers meet])."""
    return f"{_PREFIX}/{node}"


def _count_key(node: int) -> str:
    return f"{_PREFIX}/{node}/claims"


def _done_key(node: int) -> str:
    return f"{_PREFIX}/{node}/done"


@dataclass(frozen=True)
class NodeClaim:
    """What one launcher of a job says of itself: its node rank and what it was given, and
    who it is (for messages that tell two launchers apart, on one host too)."""

    #: The node rank it was given (``--node-rank``).
    node: int
    #: The hosts of the job it was given (``--nnodes``).
    nnodes: int
    #: The ranks it starts (``-n``).
    nproc: int
    host: str
    pid: int

    @classmethod
    def here(cls, node: int, nnodes: int, nproc: int) -> NodeClaim:
        """This process's claim of node ``node``."""
        return cls(node, nnodes, nproc, socket.gethostname(), os.getpid())

    @property
    def launcher(self) -> str:
        """Who made the claim: ``host pid N``."""
        return f"{self.host} pid {self.pid}"

    @property
    def shape(self) -> str:
        """What the launcher was given, as ``plait run`` spells it: ``-n P --nnodes N``."""
        return f"-n {self.nproc} --nnodes {self.nnodes}"

    def encode(self) -> bytes:
        """The claim as the store holds it."""
        fields = {"nnodes": self.nnodes, "nproc": self.nproc, "host": self.host, "pid": self.pid}
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, node: int, data: bytes) -> NodeClaim:
        """Node ``node``'s claim from what the store holds.

        Raises:
            RendezvousError: ``data`` is not a launcher's claim.
        """
        try:
            f = json.loads(data)
            return cls(node, int(f["nnodes"]), int(f["nproc"]), str(f["host"]), int(f["pid"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise RendezvousError(
                f"the store's claim of node {node} is not a plait run launcher's: "
                f"{bytes(data[:200])!r}; is another program using this store?"
            ) from exc


def meet_nodes(
    store: Store,
    claim: NodeClaim,
    timeout: float,
    *,
    stopped: Callable[[], bool] = lambda: False,
) -> bool:
    """Claim ``claim.node`` in ``store`` and wait until every node's launcher has claimed its
    own with the same ``-n`` and ``--nnodes`` (Note [launchers meet]).

    Args:
        store: the job's store (node 0's launcher serves it).
        claim: this launcher's claim.
        timeout: seconds to wait for the other launchers.
        stopped: asked after each slice of the wait; True ends it (a signal to the launcher).

    Returns:
        True once every node's launcher has claimed it and all agree; False if ``stopped``
        turned true first.

    Raises:
        MeetingError: another launcher holds ``claim.node``; launchers were given different
            ``-n`` or ``--nnodes``; another launcher failed to meet and filed why; or some
            nodes were not claimed within ``timeout`` (they are named).
        RendezvousError: the store failed (where node 0's launcher serves it: it is gone).
    """
    if store.add(_count_key(claim.node), 1) != 1:
        raise _second(store, claim)
    store.set(claim_key(claim.node), claim.encode())
    me = f"node {claim.node} ({claim.launcher}) cannot start its ranks"
    deadline = time.monotonic() + timeout
    keys = [claim_key(k) for k in range(claim.nnodes)]
    # Node 0 says when every node has come and agrees; the others wait for its word too.
    awaited = keys if claim.node == 0 else [*keys, _MET]
    seen = {claim.node: claim}
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(awaited, max(min(left, LOOK_SECONDS), 0.0))
            every = True
        except StoreTimeout:
            every = False
        if every and claim.node != 0:
            return True  # node 0 read every claim, found them alike and no notice
        for k in range(claim.nnodes):
            if k not in seen and (every or store.check([keys[k]])):
                seen[k] = NodeClaim.decode(k, store.get(keys[k], LOOK_SECONDS))
        differ = _disagreement(seen, claim)
        if differ is not None:
            _fail(store, claim, differ, seen)
            raise MeetingError(f"{me}: {differ}")
        if store.check([_NOTICE]):
            notice = store.get(_NOTICE, LOOK_SECONDS).decode(errors="replace")
            _fail(store, claim, notice, seen)
            raise MeetingError(f"{me}: {notice}")
        if every:  # node 0, and every node has come, alike, and no launcher failed
            store.set(_MET, b"1")
            return True
        if stopped():
            why = (
                f"node {claim.node}'s launcher ({claim.launcher}) was stopped before the job began"
            )
            _fail(store, claim, why, seen)
            return False
        if left <= LOOK_SECONDS:
            missing = [k for k in range(claim.nnodes) if k not in seen]
            why = (
                f"node(s) {missing} did not join within {timeout:.3g} s: no launcher claimed "
                f"them (start plait run --nnodes {claim.nnodes} --node-rank K for each, with "
                "the same --master-addr, --master-port and PLAIT_SECRET)"
            )
            _fail(store, claim, why, seen)
            raise MeetingError(f"{me}: {why}")


def _second(store: Store, claim: NodeClaim) -> MeetingError:
    """The error of a launcher whose node another launcher claimed first, filed as the
    notice for the launchers that wait."""
    try:
        data = store.get(claim_key(claim.node), GRACE_SECONDS)  # the holder sets it just after
        first = NodeClaim.decode(claim.node, data).launcher
    except StoreTimeout:
        first = "another launcher (which has not said who it is)"
    last = claim.nnodes - 1
    why = (
        f"node rank {claim.node} was given to two launchers: {first} claimed it first, and "
        f"{claim.launcher} is a second; give each of the job's {claim.nnodes} launchers its "
        f"own --node-rank in 0..{last}"
    )
    _file(store, why)
    return MeetingError(f"node {claim.node} ({claim.launcher}) cannot start its ranks: {why}")


def _disagreement(seen: dict[int, NodeClaim], claim: NodeClaim) -> str | None:
    """Why the claims ``seen`` cannot make one job, if they cannot: those that differ from
    node 0's (from ``claim`` while node 0's is not there), all named."""
    ref = seen.get(0, claim)
    differ = [c for k, c in sorted(seen.items()) if (c.nproc, c.nnodes) != (ref.nproc, ref.nnodes)]
    if not differ:
        return None
    given = ", ".join(f"node {c.node} ({c.launcher}) {c.shape}" for c in differ)
    return (
        f"the launchers disagree on the job's shape: node {ref.node} ({ref.launcher}) was "
        f"given {ref.shape}, but {given}; every launcher of one job must be given the same "
        f"-n (ranks per host) and --nnodes: expected {ref.shape} on every node, as on node "
        f"{ref.node}"
    )


def _file(store: Store, why: str) -> None:
    """File ``why`` as the notice of a failed meeting, unless a launcher filed one first."""
    if store.add(_NOTICE_COUNT, 1) == 1:
        store.set(_NOTICE, why.encode())


def _fail(store: Store, claim: NodeClaim, why: str, seen: dict[int, NodeClaim]) -> None:
    """End this holder's part in a meeting that failed for ``why`` (Note [launchers meet],
    4): file the notice, say it is done, and on node 0 wait for the others to be done."""
    _file(store, why)
    store.set(_done_key(claim.node), b"1")
    if claim.node != 0:
        return
    claimed = [k for k in range(1, claim.nnodes) if k in seen or store.check([claim_key(k)])]
    with contextlib.suppress(StoreTimeout):  # one that stopped answering finds the store gone
        store.wait([_done_key(k) for k in claimed], GRACE_SECONDS)
