"""How the ranks of ``plait.init`` meet in the job's store: each checks its arguments,
claims its rank, says its host and transport, and waits for the others. The errors name
ranks and settings, never store keys.

Note [one configuration]
    What ``auto`` follows (PLAIT_ALGO, the rules file, the profile ``plait tune`` wrote) is
    read on each rank, and a profile that cannot be read is skipped with a warning. Ranks
    that follow different ones (a profile on one host only, or unreadable on one rank)
    chose different algorithms or segments for some call, well into the job, and met there
    with a MismatchError that broke the communicator. So each rank says the fingerprint of
    its settings (:func:`plait.selection.select.fingerprint`: their content, not their
    paths) with its host, and ``init`` refuses ranks that differ, naming what each follows.

Note [jobs that share a store]
    A store served apart from the ranks (``plait store``, Redis, a shared directory)
    outlives its jobs, and the keys a job wrote stay in it: a rank's claim, its host, its
    transport's addresses. The keys of ``init`` are numbered by the process's count of
    ``init`` calls, which starts at 1 in every job, so a second job meeting there found the
    first one's claims and failed at once ("another process has already joined this job as
    rank 0"); its stale addresses would have been read as its own. So where the store comes
    from the environment, is not the job's alone (``plait run`` serves one per attempt,
    rank 0 one at MASTER_PORT + 1, the temp-dir store is named after the job) and the
    job has an id (``PLAIT_JOB_ID`` where set, whichever launcher started the ranks: the
    user's choice, and the one the error asks for; else torchrun's ``--rdzv-id``, mpirun's,
    srun's), the job meets in a namespace of that id (:func:`job_space`), and jobs of
    different ids share the store one after another or side by side. A store URL passed to
    ``init`` (``store=``) may be shared as well: it meets under PLAIT_JOB_ID where that is
    set, else in the plain namespace. A store object is the caller's, whose keys the caller
    places (the torch backend's is torch's, one per job). A store of the job's own keeps
    the plain namespace: the launchers of ``plait run --nnodes`` name the job after
    ``--master-addr`` as each was given it, which two hosts may spell differently. A job id
    used again meets the old claims: the error says so, and what to set. Keys are never
    deleted: a job that fails midway could not, and a later job must not depend on whether
    an earlier one ended cleanly.

Note [refused alike]
    Every rank reads the same keys, all set before any rank's wait for them ends, so every
    rank refuses a meeting alike (different transports or settings, machines of one host
    name), naming the ranks and their settings. But where rank 0 serves the store
    (MASTER_ADDR), its process may end as it raises, taking the store along while another
    rank still reads the keys, whose read then failed with the store's own words (a
    connection reset, a key). So there each other rank that refuses says so in the store
    (``refused/<rank>``), and rank 0 waits for all of them to have said so before it raises:
    every rank has then read what it refuses. Only a rank that dies in between keeps it
    waiting, at most for the rest of ``init``'s timeout; a meeting that goes well costs
    nothing more.

Note [ranks that never came]
    The temp-dir file store is deleted by the rank that counts the last rank out (Note
    [store lifetime] in plait._init), and a rank that never came (never started, killed
    before ``init``) never counts itself out. So a rank that times out waiting for ranks
    counts out those of them it is first to claim: it adds :data:`GONE` to each one's claim,
    and counts it out where the sum is GONE (nobody had claimed it). Each rank that never
    came is counted out once, whichever ranks time out, and the last rank that came to leave
    deletes the directory. A rank that comes later finds GONE in its claim: it is told that
    another rank gave up waiting for it, and takes back the count it adds again as it leaves.

Note [two worlds in one process]
    A communicator's id names its flight recorder's dumps (``rank<r>.json`` for the job's
    world, id 0) and sits in its wire tags. A process may make the job's world twice, both
    open at once: ``plait.init`` beside torch's ``init_process_group("plait")``, or two
    ``init`` calls. Both had id 0, and their dumps went to one file, the later over the
    earlier (``plait analyze`` then read one rank's dump as another's). The ids must agree
    across the ranks, for the tags, so each rank says with its host whether it already has
    a world open (:func:`world_open`), and where any rank has, every rank gives the new one
    an id of its own, drawn from the run token all of them read (``own_comm_id``).
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse
import weakref
from collections.abc import Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any

from plait.errors import CommError, RendezvousError
from plait.rendezvous.lost import JobRanks, mark_joined, wait_ranks
from plait.rendezvous.store import PrefixStore, Store

if TYPE_CHECKING:
    from plait._init import LaunchInfo

__all__ = [
    "TRANSPORTS",
    "check_arguments",
    "claim_rank",
    "init_space",
    "job_space",
    "leave",
    "machine",
    "meet",
]

#: The transports ``init`` takes by name (``transport=`` or PLAIT_TRANSPORT).
TRANSPORTS = ("auto", "shm", "tcp", "hybrid")
#: What a rank that timed out adds to the claim of a rank that never came, to count it out
#: (Note [ranks that never came]): more than processes that share a rank ever add.
GONE = 1 << 20


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


def job_space(info: LaunchInfo, *, url: bool = False) -> str | None:
    """The id that names this job's namespace of its store, if it needs one (Note [jobs that
    share a store]). ``url``: the store is a URL passed to ``init``, which meets under
    PLAIT_JOB_ID where it is set. Else the store is the environment's: a store served apart
    from the job meets under the job's id (``info.job_id``: PLAIT_JOB_ID, else the
    launcher's); None for a store of this job alone (``plait run``'s, one per attempt; rank
    0's at MASTER_PORT + 1; the temp dir's, named after the job), and for torchrun's default
    run id, "none"."""
    if url:
        return os.environ.get("PLAIT_JOB_ID", "").strip() or None
    if info.store_by_rank0 or info.store_is_temp or os.environ.get("PLAIT_LAUNCHER_PID"):
        return None
    job = info.job_id
    return None if job is None or job == "none" else job


def init_space(generation: int, job_id: str | None) -> str:
    """The namespace of the store in which the ``generation``-th ``plait.init`` of each
    rank's process meets, under ``job_id`` (:func:`job_space`'s) where it has one."""
    space = f"plait/init{generation}"
    return space if job_id is None else f"{space}/job/{urllib.parse.quote(job_id, safe='')}"


def claim_rank(
    group: PrefixStore, rank: int, size: int, job: str | None = None, launcher: str = "plait"
) -> None:
    """Claim ``rank`` in the job's store: two processes given one rank are told at once
    (the second; the first would only time out waiting for the rank that neither is).

    ``job``: the id the job meets under, if any (Note [jobs that share a store]), and
    ``launcher`` (:class:`~plait._init.LaunchInfo`'s), for the error's advice.

    Raises:
        RendezvousError: another process has claimed this rank.
    """
    if job is not None and job == os.environ.get("PLAIT_JOB_ID", "").strip():
        launcher = "plait"  # the id is PLAIT_JOB_ID, whoever started the ranks
    claims = group.add(f"claim/{rank}", 1)
    if claims > GONE:  # Note [ranks that never came]
        with contextlib.suppress(CommError, OSError):
            group.add("left", -1)  # counted out already: init counts it again as it leaves
        raise RendezvousError(
            f"rank {rank} of {size}: another rank gave up waiting for this rank (it timed "
            "out) before this rank called plait.init: start every rank within the timeout "
            "(PLAIT_TIMEOUT)"
        )
    if claims > 1:
        own = {
            "plait": "give each job an id of its own (PLAIT_JOB_ID)",
            "torchrun": "give each job a run id of its own (torchrun's --rdzv-id); a "
            "restart keeps it (its count can differ from node to node), so for restarts leave "
            "PLAIT_STORE unset: rank 0 then serves each attempt a store of its own",
        }.get(launcher, "give each job a store of its own")
        again = (
            f"an earlier job of the same id ({job!r}) met in this store: {own}"
            if job is not None
            else "an earlier job met in this store, which keeps its keys: give each job an "
            "id of its own (PLAIT_JOB_ID; torchrun's --rdzv-id), or a store of its own"
        )
        raise RendezvousError(
            f"rank {rank} of {size}: another process has already joined this job as rank "
            f"{rank}: two processes were given the same rank (RANK, PLAIT_RANK or init(rank=)), "
            f"or {again}"
        )
    if isinstance(group, JobRanks):  # the launcher's store (Note [ranks that never joined])
        mark_joined(group, rank)


#: The job's world communicators this process has made (Note [two worlds in one process]).
_worlds: weakref.WeakSet[Any] = weakref.WeakSet()


def world_open() -> bool:
    """Whether this process has a communicator of the job's world open."""
    return any(not c.closed for c in list(_worlds))


def world_made(comm: Any) -> None:
    """Count ``comm`` among this process's worlds (:func:`world_open`)."""
    _worlds.add(comm)


def meet(
    group: PrefixStore,
    rank: int,
    size: int,
    mine: tuple[str, str, str],
    seconds: float,
    timeout: float | None,
    info: LaunchInfo,
    *,
    temp: bool = False,
    world: bool = False,
) -> tuple[list[str], bool]:
    """Say this rank's host, transport and settings' fingerprint (``mine``), wait until every
    rank has said its own, and return every rank's host, and whether any rank that makes the
    job's world (``world``) has one open already (Note [two worlds in one process]); errors
    that name the ranks, not store keys. ``temp``: the store is the temp-dir file store, in
    which a rank that times out counts out the ranks that never came (Note [ranks that never
    came]).

    Raises:
        StoreTimeout: some ranks never arrived (named) within ``timeout``.
        RendezvousError: the store went away (where rank 0 served it: rank 0 failed), the
            ranks were given different transports or settings, or ranks of one host name are
            on different machines (on every rank: Note [refused alike]).
    """
    from plait.rendezvous.store import StoreTimeout

    again = "1" if world and world_open() else "0"
    group.set(f"host/{rank}", "\n".join((*mine, again, machine())).encode())
    keys = [f"host/{r}" for r in range(size)]
    try:
        wait_ranks(
            group, keys, range(size), timeout, me=f"rank {rank} of {size}", what="say their host"
        )
        told = [group.get(key).decode().split("\n", 4) for key in keys]
    except StoreTimeout:
        try:
            missing = [r for r in range(size) if not group.check([keys[r]])]
        except RendezvousError:
            missing = []
        if temp:
            _count_out(group, missing)
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
            f"{info.store_url} went away before the ranks had met: rank 0 failed or gave up "
            f"(see its error) ({exc})"
        ) from exc
    try:
        _same_transport(rank, [kind for _, kind, _, _, _ in told])
        _same_settings(rank, [config for _, _, config, _, _ in told])
        hosts = [host for host, _, _, _, _ in told]
        _one_machine_per_host(rank, hosts, [where for _, _, _, _, where in told])
    except RendezvousError:
        if info.store_by_rank0:  # Note [refused alike]
            _refused_alike(group, rank, size, timeout, serves=info.store_is_server)
        raise
    return hosts, any(again == "1" for _, _, _, again, _ in told)


def _refused_alike(
    group: PrefixStore, rank: int, size: int, timeout: float | None, *, serves: bool
) -> None:
    """Where rank 0 serves the store: it waits until every other rank has read what they
    all refuse, and said so (Note [refused alike]). Best effort: the refusal is the error."""
    with contextlib.suppress(CommError, OSError):
        if not serves:
            group.set(f"refused/{rank}", b"")
        else:
            group.wait([f"refused/{r}" for r in range(size) if r != rank], timeout)


def _count_out(group: PrefixStore, missing: Sequence[int]) -> None:
    """Count out the ``missing`` ranks this rank is first to claim (Note [ranks that never
    came]). Best effort, as :func:`leave`."""
    for r in missing:
        with contextlib.suppress(CommError, OSError):
            if group.add(f"claim/{r}", GONE) == GONE:
                group.add("left", 1)


def leave(store: Store, group: PrefixStore, size: int, *, temp: bool) -> None:
    """This rank is done with a store ``init`` opened: count it out, then close the store.

    See Note [store lifetime] in plait._init. Best effort: the communicator (or the error
    being raised) matters more than the bookkeeping, so failures here pass.
    """
    try:
        if temp:
            with contextlib.suppress(Exception):
                if group.add("left", 1) >= size:
                    store.cleanup()  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(Exception):
            store.close()


def _same_settings(rank: int, configs: Sequence[str]) -> None:
    """RendezvousError where the ranks follow different settings for ``auto`` (Note [one
    configuration]), naming what each follows."""
    digests = [config.partition(" ")[0] for config in configs]
    if len(set(digests)) > 1:
        seen: dict[str, list[int]] = {}
        for r, digest in enumerate(digests):
            seen.setdefault(digest, []).append(r)
        told = "; ".join(
            f"rank(s) {ranks}: {configs[ranks[0]].partition(' ')[2]}" for ranks in seen.values()
        )
        raise RendezvousError(
            f"rank {rank}: the ranks follow different settings for algorithm='auto' ({told}): "
            "they would choose different algorithms for some call and fail there; give every "
            "rank the same PLAIT_ALGO, rules file (PLAIT_RULES) and profile (PLAIT_PROFILE, "
            "written by plait tune), or none"
        )


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
