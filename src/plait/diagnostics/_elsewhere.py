"""What the dumps of a job's other communicators say of a rank that left none for one.

Note [dumps of other communicators]
    A rank without a dump for communicator C may have dumped for another communicator D
    of the job. That was read as "stuck or failed there", which holds only where the dump
    of D tells where the rank is while C's ranks wait for it. Two kinds of D's dump do not:

    - one of a communicator C was shrunk from (directly or through others): the rank
      took part in the shrink that made C, so it had left D before C existed. Shrink
      draws the new id from the old one and its agreement number
      (:func:`plait.diagnostics.places.shrunk_comm_id`), so the dumps' ids are the lineage;
    - one written before C's first call began on any rank whose dump holds that call
      (#0), where the call D's dump found the rank in had ended (failed or done): the
      rank went on after it.

    Such a rank is judged as one that left no dump at all (the launcher's note, the
    others' errors). And a rank whose dump is of a communicator shrunk from C (directly or
    through others) went on to it: it left C, which was replaced, and is neither stuck
    in C nor dead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from plait.diagnostics.places import shrunk_comm_id
from plait.diagnostics.schema import Dump

__all__ = ["AGREEMENTS", "lost_ranks", "shrunk_from", "whereabouts"]

#: Agreement numbers of a communicator tried when looking for the one shrunk from it.
AGREEMENTS = 4096


def shrunk_from(comms: Iterable[int]) -> dict[int, int]:
    """Of communicator ids ``comms``, each one's parent among them: the one it was made from
    by ``shrink`` (Note [dumps of other communicators])."""
    ids = set(comms)
    parent: dict[int, int] = {}
    for c in sorted(ids):
        for k in range(AGREEMENTS):
            child = shrunk_comm_id(c, k)
            if child in ids and child != c:
                parent.setdefault(child, c)
    return parent


def _ancestors(comm: int, parent: Mapping[int, int]) -> list[int]:
    """``comm``'s parent, its parent's parent, and so on (nearest first)."""
    out: list[int] = []
    while comm in parent and parent[comm] not in out and parent[comm] != comm:
        comm = parent[comm]
        out.append(comm)
    return out


def _began(dumps: Sequence[Dump]) -> float | None:
    """When the first call of the communicator of ``dumps`` began on the first rank, where a
    dump holds call #0; else None."""
    starts = [
        t for d in dumps for c in d.calls if c.seq == 0 and (t := c.queued or c.start) is not None
    ]
    return min(starts) if starts else None


def whereabouts(job: Sequence[Dump], comm: int) -> tuple[set[int], dict[int, tuple[int, int]]]:
    """For communicator ``comm`` of a job whose dumps are ``job``: the job ranks whose
    dump of another communicator may say where they are (stuck or failed there), and the
    job ranks that went on to a communicator shrunk from ``comm``, with its id and how
    many shrinks made it from ``comm`` (1: from ``comm`` itself); Note [dumps of other
    communicators]."""
    parent = shrunk_from({d.comm for d in job})
    mine = [d for d in job if d.comm == comm]
    began = _began(mine)
    older = set(_ancestors(comm, parent))
    there: set[int] = set()
    moved: dict[int, tuple[int, int]] = {}
    for d in sorted(job, key=lambda d: d.time):
        g = d.job_rank(d.rank)
        if d.comm == comm or g is None:
            continue
        line = _ancestors(d.comm, parent)
        if comm in line:
            moved[g] = (d.comm, line.index(comm) + 1)
            continue
        stuck = d.stuck
        if d.comm in older or (
            began is not None and d.time < began and (stuck is None or not stuck.in_flight)
        ):
            continue
        there.add(g)
    return there - set(moved), moved


_LOST = re.compile(r"\bPeerLostError\b.*?\brank (\d+) was lost\b")


def lost_ranks(dumps: Iterable[Dump]) -> set[int]:
    """The ranks that the failed calls of ``dumps`` say were lost (``PeerLostError: ... rank
    2 was lost``), numbered as their communicator numbers them."""
    out: set[int] = set()
    for d in dumps:
        for c in d.calls:
            if c.state == "failed" and c.error and (m := _LOST.search(c.error)):
                out.add(int(m.group(1)))
    return out
