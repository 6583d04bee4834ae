"""How the ranks of ``plait.init`` meet in the job's store: each checks its arguments,
claims its rank, says its host and transport, and waits for the others. The errors name
ranks and settings, never store keys."""

from __future__ import annotations

import os
from collections.abc import Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any

from plait.errors import RendezvousError
from plait.rendezvous.lost import wait_ranks
from plait.rendezvous.store import PrefixStore

if TYPE_CHECKING:
    from plait._init import LaunchInfo

__all__ = ["TRANSPORTS", "check_arguments", "claim_rank", "machine", "meet"]

#: The transports ``init`` takes by name (``transport=`` or PLAIT_TRANSPORT).
TRANSPORTS = ("auto", "shm", "tcp", "hybrid")


def check_arguments(rank: Any, size: Any, store: Any, transport: Any) -> None:
    """TypeError for an argument of ``init`` of the wrong type, before anything moves."""
    for name, value in (("rank", rank), ("size", size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
            raise TypeError(f"init: {name} must be an int; got {value!r}")
    if store is not None and not isinstance(store, str) and not hasattr(store, "get"):
        raise TypeError(f"init: store must be a Store or a store URL; got {store!r}")
    if transport is not None and not isinstance(transport, str) and not hasattr(transport, "rank"):
        raise TypeError(
            f"init: transport must be one of {', '.join(TRANSPORTS)} or a connected transport; "
            f"got {transport!r}"
        )


def _same_transport(rank: int, kinds: Sequence[str]) -> None:
    """RendezvousError where the ranks were told different transports (each would wait for
    the others on its own kind of link until the timeout, blaming a rank that never came)."""
    if len(set(kinds)) > 1:
        told = ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
        raise RendezvousError(
            f"rank {rank}: the ranks were given different transports ({told}): set "
            "PLAIT_TRANSPORT (or init(transport=)) alike on every rank"
        )


def claim_rank(group: PrefixStore, rank: int, size: int) -> None:
    """Claim ``rank`` in the job's store: two processes given one rank are told at once
    (the second; the first would only time out waiting for the rank that neither is).

    Raises:
        RendezvousError: another process has claimed this rank.
    """
    if group.add(f"claim/{rank}", 1) > 1:
        raise RendezvousError(
            f"rank {rank} of {size}: another process has already joined this job as rank "
            f"{rank}: two processes were given the same rank (RANK, PLAIT_RANK or init(rank=))"
        )


def meet(
    group: PrefixStore,
    rank: int,
    size: int,
    mine: tuple[str, str],
    seconds: float,
    timeout: float | None,
    info: LaunchInfo,
) -> list[str]:
    """Say this rank's host and transport (``mine``), wait until every rank has said its
    own, and return every rank's host; errors that name the ranks, not store keys.

    Raises:
        StoreTimeout: some ranks never arrived (named) within ``timeout``.
        RendezvousError: the store went away (where rank 0 served it: rank 0 failed), the
            ranks were given different transports, or ranks of one host name are on
            different machines.
    """
    from plait.rendezvous.store import StoreTimeout

    group.set(f"host/{rank}", "\n".join((*mine, machine())).encode())
    keys = [f"host/{r}" for r in range(size)]
    try:
        wait_ranks(
            group, keys, range(size), timeout, me=f"rank {rank} of {size}", what="say their host"
        )
    except StoreTimeout:
        try:
            missing = [r for r in range(size) if not group.check([keys[r]])]
        except RendezvousError:
            missing = []
        who = f"rank(s) {missing}" if missing else "some ranks"
        raise StoreTimeout(
            f"rank {rank} of {size}: plait.init timed out after {seconds:g} s waiting for "
            f"{who} to arrive: they never called plait.init (not started yet, failed or "
            "killed during start-up, or given another store or job id)"
        ) from None
    except RendezvousError as exc:
        if not info.store_by_rank0 or rank == 0:
            raise
        raise RendezvousError(
            f"rank {rank} of {size}: plait.init: the store that rank 0 serves at "
            f"{info.store_url} went away before every rank arrived: rank 0 failed or gave up "
            f"(see its error) ({exc})"
        ) from exc
    told = [group.get(key).decode().rsplit("\n", 2) for key in keys]
    _same_transport(rank, [kind for _, kind, _ in told])
    hosts = [host for host, _, _ in told]
    _one_machine_per_host(rank, hosts, [where for _, _, where in told])
    return hosts


def machine() -> str:
    """What makes processes able to share memory the way the shared-memory transport does:
    one kernel (its boot id) and one network namespace (its abstract socket names); "" where
    either cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def _one_machine_per_host(rank: int, hosts: Sequence[str], machines: Sequence[str]) -> None:
    """RendezvousError where ranks of one host name are on different machines (cloned
    virtual machines, containers, network namespaces): taken for one host, they would try
    shared memory and fail, each blaming the other for giving up or dying."""
    seen: dict[str, dict[str, list[int]]] = {}
    for r, (host, where) in enumerate(zip(hosts, machines, strict=True)):
        if where:
            seen.setdefault(host, {}).setdefault(where, []).append(r)
    for host, places in seen.items():
        if len(places) > 1:
            groups = "; ".join(f"ranks {rs}" for rs in places.values())
            raise RendezvousError(
                f"rank {rank}: ranks on different machines (or network namespaces) have one "
                f"host name, {host!r} ({groups}), so shared memory cannot join them: give each "
                "machine a name of its own (PLAIT_HOST)"
            )
