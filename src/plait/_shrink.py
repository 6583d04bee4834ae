"""``comm.shrink()``: a new communicator of the surviving ranks (Note [shrink] in
:mod:`plait._recovery`)."""

from __future__ import annotations

import contextlib
import time

from plait._abort import aborted_by, mark
from plait._checks import check_timeout
from plait._liveness import Liveness, survivors_store
from plait._recovery import closed_error, enable, owned
from plait.communicator import Communicator
from plait.errors import ClosedError, CommError, PeerLostError, RendezvousError
from plait.group import shrunk_comm_id
from plait.rendezvous.lost import report_gave_up, wait_ranks
from plait.rendezvous.store import PrefixStore, Store, answers_by
from plait.transport.base import Transport
from plait.transport.memory import MemoryFabric

__all__ = ["shrink"]

#: Seconds beyond its deadline shrink's store calls may wait for their answers.
_ANSWER_SLACK = 1.0


def shrink(comm: Communicator, timeout: float | None) -> Communicator:
    """See :meth:`Communicator.shrink` and Note [shrink]."""
    seconds = (
        comm.timeout if timeout is None else check_timeout(timeout, f"rank {comm.rank}: shrink")
    )
    deadline = time.monotonic() + seconds
    rec = owned(comm, "shrink")
    if rec is None:  # a lone rank: a new one (an id of its own: its dumps), the old closed
        new = Communicator(
            MemoryFabric(1).endpoints[0],
            timeout=comm.timeout,
            hosts=comm.hosts,
            _comm_id=shrunk_comm_id(comm._comm_id, 1),
            _settings=comm._settings,
            _world_rank=comm._world_rank,
            _run=comm._run,
            _members=None if comm._members is None else [comm._members[comm.rank]],
        )
        mark(comm, aborted_by(comm.rank, "replaced by shrink()"))  # as a shrink of many says
        comm.close()
        return new
    if rec._closed:
        raise closed_error(comm, "shrink")

    def leave() -> None:  # every rank still in a call on the old communicator leaves it
        # (before the agreement is known: the shrink may yet fail, so not "replaced")
        rec.abort("left for shrink()", here=True)

    if comm._runner.broken is not None:  # failed or aborted here: peers may be stuck in a call
        leave()
    agreement, k = rec.agree(1, seconds, "shrink", leave)
    done = None if comm._runner.broken else rec._mark(aborted_by(rec.rank, "replaced by shrink()"))
    if done is not None:  # every rank came: no call to leave, but later ones (a group's) say why
        rec._told_nobody(done)
    members = agreement.ranks
    size = len(members)
    rank = members.index(comm.rank)
    hosts = [comm.hosts[p] for p in members]
    namespace = f"{rec.namespace}/s{k}"
    owner = rec.owner
    # No store call outlasts shrink's own deadline (Note [a store that stalls]).
    with answers_by(deadline + _ANSWER_SLACK):
        owner.acquire()  # the new communicator's, until its Recovery holds its own
        try:
            left = max(deadline - time.monotonic(), 0.001)
            if size == 1:
                transport: Transport = MemoryFabric(1).endpoints[0]
            else:
                from plait.transport.route import connect

                # Waits that end when a survivor dies (Note [survivors that die]).
                store = survivors_store(namespace, owner.store, rec.live, members)
                try:
                    transport = connect(rank, size, hosts, store, links=rec.links, timeout=left)
                    # Where this rank runs, in the new namespace before it says it connected:
                    # one that dies after that is seen gone at once (Note [survivors that die]).
                    Liveness(PrefixStore(namespace, owner.store)).publish(rank)
                    _all_connected(transport, store, comm.rank, rank, size, deadline)
                except (RendezvousError, PeerLostError, ClosedError, OSError) as exc:
                    report_gave_up(store, rank, str(exc))  # Note [ranks that gave up]
                    raise RendezvousError(
                        f"rank {comm.rank}: shrink: the {size} survivors {list(members)} could not "
                        f"connect ({exc}); if one failed meanwhile, agree and shrink again"
                    ) from exc
            new = Communicator(
                transport,
                timeout=comm.timeout,
                hosts=hosts,
                _comm_id=shrunk_comm_id(comm._comm_id, k),
                _settings=comm._settings,
                _world_rank=comm._world_rank,
                _run=comm._run,
                _members=None if comm._members is None else [comm._members[p] for p in members],
            )
            enable(new, owner, namespace, rec.links)
        finally:
            owner.release()
    if rank == 0 and owner.count_out is not None:
        with contextlib.suppress(CommError, OSError):
            owner.count_out(comm.size - size)
    if done is None:  # failed or aborted before: later calls say why, and that it was replaced
        for m in list(rec._members):
            runner = m._runner
            why = runner.aborted
            if why is None and runner.broken is not None:
                why = f"it was unusable after an earlier failure ({runner.broken})"
            if why:
                mark(m, f"{why}; then replaced by shrink()")
            else:
                mark(m, aborted_by(rec.rank, "replaced by shrink()" if rec.owns(m) else _SPLIT))
    comm.close()
    return new


#: Why a group split from a communicator that shrink replaced is aborted.
_SPLIT = "the communicator it was split from was replaced by shrink()"


def _all_connected(
    transport: Transport, store: Store, old: int, rank: int, size: int, deadline: float
) -> None:
    """Return once every survivor has connected; else close ``transport`` and raise.

    Note [survivors connect, then agree]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A rank's set-up can end well while a peer's fails: the peer connected to
    some survivors and died (or gave up) before it connected to the others.
    Returning then would leave the survivors in different communicators (those
    whose set-up ended well in one that includes the peer, the others retrying
    the shrink on the old one, which the first have closed: each went on
    alone). So every survivor says it connected (``connected/<rank>`` in the
    set-up's namespace) and returns only once all have; one that died or gave
    up before saying so fails every survivor's shrink within about a second
    (Note [survivors that die] in plait._liveness), and every one agrees and
    shrinks again. Every survivor sees the same keys (Note [a key set before a
    death] in plait.rendezvous.lost), so all return, or all raise.
    """
    try:
        store.set(f"connected/{rank}", b"1")
        wait_ranks(
            store,
            [f"connected/{r}" for r in range(size)],
            range(size),
            max(deadline - time.monotonic(), 0.001),
            me=f"rank {old}",
            what="finish connecting",
        )
    except BaseException:
        transport.close()
        raise
