"""What a call is, in words: its signature, as mismatch errors show it and
``PLAIT_DEBUG=detail`` compares it across ranks before every call.

Note [the detail check]
    Under PLAIT_DEBUG=detail every call is first compared across ranks: each rank
    allgathers its call's signature (:func:`check_same_call`). That allgather needs a
    number of its own on the wire (a call's number is in every tag of its messages, Note
    [wire tags] in :mod:`plait.group`), so each call takes two numbers there, ``2n`` for
    its check and ``2n + 1`` for itself, while ``n`` is the number users see: in errors,
    in the flight recorder, the timeline and ``stragglers``, as without the check (the
    setting is fixed for a communicator's life, so every call takes two). The check is a
    part of its call, not a call of its own: it runs in the call's recorder slot, opened
    when the rank reached the call (so lateness counts from there, and a dump while the
    check waits shows the user's call in flight, waiting for the peers the check waits
    for), and takes no slot; it goes through the communicator's ``allgather`` to be
    planned, and the call runner, seeing the thread in a check (``checking``), runs it
    with :func:`run_check` instead of numbering it. A check that fails (a timeout, a lost
    peer, a peer that does not check: its digest differs) or finds different calls fails
    the call: the communicator is broken, the slot ended and dumped, and the
    ``MismatchError`` names the call, its number and the dump, as any other.
"""

from __future__ import annotations

import ast
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import CommError, MismatchError
from plait.group import collective_tag
from plait.runtime.executor import Call, execute

if TYPE_CHECKING:
    from plait._edge import CollectiveMethods
    from plait._request import Request
    from plait._runner import CallRunner
    from plait.diagnostics.recorder import Slot
    from plait.transport.base import Transport

__all__ = [
    "SIGNATURE_BYTES",
    "check_call",
    "check_same_call",
    "format_bytes",
    "run_check",
    "signature",
]


def signature(req: Request) -> str:
    """What a call is, as PLAIT_DEBUG=detail compares it and mismatch errors show it.

    Every field the check word covers (see :func:`call_digest`). The segment
    is in bytes, formatted as the log of auto's choices formats it (``1 MiB``);
    the schedule counts it in elements.
    """
    ctx = req.ctx
    dtype = req.out.dtype
    op = req.op.name if req.op is not None else "-"
    segment = format_bytes(ctx.segment * dtype.itemsize)
    if req.plan.rows:  # an uneven call: its rows, where the counts are of elements
        count = _rows(req.plan.rows, ctx.counts)
    elif ctx.counts is not None:
        count = f"counts={list(ctx.counts)}"
    else:
        count = f"count={ctx.count}"
    within = f"{req.plan.purpose}: " if req.plan.purpose else ""
    return (
        f"{within}{ctx.collective}({count}, dtype={dtype.name}, op={op}, "
        f"root={ctx.root}, algorithm={req.spec.name}, segment={segment})"
    )


def _rows(layout: str, counts: tuple[int, ...] | None) -> str:
    """An uneven call's rows as its caller counted them: ``layout`` as the call's plan keeps
    it ("rows [...] of shape ...", or "row shape (3,)" with the element ``counts``)."""
    if not layout.startswith("row shape ") or counts is None:
        return layout
    rest = ast.literal_eval(layout.removeprefix("row shape "))
    row = math.prod(rest)
    return f"rows {[k // row for k in counts]} of shape {rest}"


#: Bytes of the signature each rank allgathers under PLAIT_DEBUG=detail (longer ones are cut).
SIGNATURE_BYTES = 160


def check_same_call(
    comm: Any, req: Request, seconds: float, rank: int, what: str
) -> MismatchError | None:
    """PLAIT_DEBUG=detail: allgather every rank's call signature (through ``comm``, within
    ``seconds``); where they differ, the MismatchError of call ``what`` (``allreduce (ring,
    call #5)``) naming the ranks of each call, else None.

    Costs one small allgather per call; the default check (a digest in every
    message header) costs nothing extra but can only say that calls differ.
    """
    text = signature(req).encode()[: SIGNATURE_BYTES - 1]
    mine = np.zeros(SIGNATURE_BYTES, np.uint8)
    mine[: len(text)] = np.frombuffer(text, np.uint8)
    try:
        table = comm.allgather(mine, algorithm="bruck", timeout=seconds)
    except MismatchError as exc:  # a peer in the user's call: it does not check calls
        noted = MismatchError(
            f"{exc}; this rank checks every call first (PLAIT_DEBUG=detail): if the others "
            "do not, set PLAIT_DEBUG alike on every rank"
        )
        noted.__dict__.update(exc.__dict__)
        raise noted from exc
    calls: dict[str, list[int]] = {}
    for r, row in enumerate(table):
        calls.setdefault(bytes(row).rstrip(b"\0").decode(errors="replace"), []).append(r)
    if len(calls) < 2:
        return None
    detail = "; ".join(f"ranks {ranks}: {sig}" for sig, ranks in calls.items())
    return MismatchError(f"rank {rank}: {what}: ranks made different calls: {detail}")


def check_call(
    runner: CallRunner,
    req: Request,
    wire: int,
    seconds: float,
    label: tuple[str, str, int],
    slot: Slot | None,
    comm: CollectiveMethods,
) -> None:
    """PLAIT_DEBUG=detail: compare call ``req`` (``label``) across ranks, as a part of it
    (Note [the detail check]): ``wire`` is the check's number on the wire, ``slot`` the call's
    recorder slot, begun (None without a recorder). Raises what the call raises. A part
    of the call runner, kept here with the check."""
    start = slot.start if slot is not None else 0.0  # 0.0: queued on the worker
    rec = runner.recorder if slot is not None else None
    tag = collective_tag(runner._comm_id, wire)
    deadline = (start or time.monotonic()) + seconds
    held = runner._workspaces
    held.checking = (runner._transport, (label, tag, deadline, slot, rec, wire, runner._probe_tag))
    what = f"{label[0]} ({label[1]}, call #{label[2]})"
    try:
        found = check_same_call(comm, req, seconds, runner._rank, what)
    except CommError as exc:
        raise runner._failed(exc, req, label, slot) from exc.__cause__
    except BaseException as exc:
        runner._left(exc, req, label, slot)
        raise
    finally:
        held.checking = None
    if found is not None:
        raise runner._failed(found, req, label, slot, True)


def run_check(req: Request, transport: Transport, fields: tuple[Any, ...]) -> Any:
    """Run the check's allgather ``req`` on ``transport`` as :func:`check_call` said
    (``fields``): in the call's slot, which it leaves open, and numbered as the check."""
    label, tag, deadline, slot, rec, wire, probe = fields
    plan = req.plan
    call = Call(label, tag, plan.check, plan.ufunc, deadline, slot, rec, None, -1, wire, probe)
    tmp = np.empty(plan.schedule.tmp_count, req.out.dtype)
    execute(plan.schedule, (req.inp, req.out, tmp), transport, call, None, req.aliased)
    return req.result


def format_bytes(n: int) -> str:
    """``n`` bytes for a log line: 256 KiB, 1 MiB, 100 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
