"""What a call is, in words: its signature, as mismatch errors show it and
``PLAIT_DEBUG=detail`` compares it across ranks before every call."""

from __future__ import annotations

import ast
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import MismatchError

if TYPE_CHECKING:
    from plait._request import Request

__all__ = ["SIGNATURE_BYTES", "check_same_call", "format_bytes", "signature"]


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


def check_same_call(comm: Any, req: Request, seconds: float, rank: int) -> None:
    """PLAIT_DEBUG=detail: allgather every rank's call signature (through ``comm``, within
    ``seconds``) and raise MismatchError naming the ranks of each call when they differ.

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
    if len(calls) > 1:
        detail = "; ".join(f"ranks {ranks}: {sig}" for sig, ranks in calls.items())
        raise MismatchError(f"rank {rank}: ranks made different calls: {detail}")


def format_bytes(n: int) -> str:
    """``n`` bytes for a log line: 256 KiB, 1 MiB, 100 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
