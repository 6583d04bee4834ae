"""``simulate(with_data=True)``: real inputs, the buffers they start in, the check of the results.

Every rank gets its ``x`` as a communicator call would take it (flat), the
schedules move and reduce real numpy data (:class:`plait.sim.engine.Data`),
and :func:`check` compares every rank's ``OUT`` with the numpy reference of
the table of collectives (:func:`plait.collectives.reference`), then, for a
replicated reduction, that every rank holds the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plait.collectives import get as _collective
from plait.ops import Op
from plait.schedule.ir import Schedule
from plait.sim.engine import Data, Outcome

__all__ = ["SimCheckError", "check", "input_arrays", "start_buffers"]


class SimCheckError(AssertionError):
    """With data: a rank's result differs from the numpy reference."""


def input_arrays(
    collective: str,
    p: int,
    count: int,
    dt: np.dtype,
    given: Sequence[np.ndarray | None] | None,
    seed: int,
    *,
    counts: tuple[int, ...] | None = None,
    root: int = 0,
) -> list[np.ndarray | None]:
    """Each rank's ``x`` as the communicator takes it (flat); random unless given.

    With an uneven call's ``counts`` each rank's ``x`` is as long as its
    ``IN`` (empty where the call reads none, as scatterv off root).
    """
    table = _collective(collective)
    if table.synchronizes:
        return [None] * p
    n = p * count if table.split_input else count
    sizes = [n] * p
    if counts is not None:
        sizes = [table.buffer_counts(p, 0, r, root, counts)[0] for r in range(p)]
    if given is not None:
        if len(given) != p:
            raise ValueError(f"inputs: {len(given)} arrays for {p} ranks")
        xs: list[np.ndarray | None] = []
        for r, x in enumerate(given):
            if x is None:
                xs.append(None)
                continue
            a = np.ascontiguousarray(np.asarray(x, dtype=dt)).reshape(-1)
            if a.size != sizes[r]:
                raise ValueError(f"inputs[{r}] has {a.size} elements; the call needs {sizes[r]}")
            xs.append(a)
        return xs
    rng = np.random.default_rng(seed)
    out: list[np.ndarray | None] = []
    for n in sizes:
        if dt.kind == "b":
            out.append(rng.integers(0, 2, n).astype(dt))
        elif dt.kind in "iu":
            out.append(rng.integers(0, 100, n).astype(dt))
        else:  # small integers stay exact whatever order a float sum takes
            out.append(rng.integers(-8, 9, n).astype(dt))
    return out


def start_buffers(
    collective: str,
    schedules: Sequence[Schedule],
    xs: list[np.ndarray | None],
    dt: np.dtype,
    root: int,
    op: Op,
) -> Data:
    """Every participant's ``(IN, OUT, TMP, SHARED)`` as the executor starts them, and the op."""
    table = _collective(collective)
    bufs = []
    for r, s in enumerate(schedules):
        x = xs[r] if r < len(xs) else None  # a fabric's switches have no input
        inp = np.zeros(s.in_count, dt)
        if s.in_count and x is not None:
            inp[...] = x
        if table.fills_x:  # root's x is its OUT
            out = (
                np.array(x, dtype=dt) if r == root and x is not None else np.zeros(s.out_count, dt)
            )
        else:
            out = np.zeros(s.out_count, dt)
        bufs.append((inp, out, np.zeros(s.tmp_count, dt), np.zeros(s.shared_count, dt)))
    return Data(bufs, op.kernel(dt) if table.reduces else np.bitwise_or)


def check(
    collective: str,
    out: Outcome,
    xs: list[np.ndarray | None],
    op: Op,
    root: int,
    p: int,
    *,
    counts: tuple[int, ...] | None = None,
) -> list[np.ndarray | None]:
    """Every rank's result (None where the call returns nothing), checked against the reference.

    ``counts``: an uneven call's per-rank counts, which the reference reads too.

    Raises:
        ValueError: a rank whose input the result needs has none.
        SimCheckError: a result that differs from the reference, or a replicated
            reduction whose ranks differ in any bit.
    """
    table = _collective(collective)
    assert out.buffers is not None
    results: list[np.ndarray | None] = []
    for r in range(p):
        o = out.buffers[r][1]
        if table.reduces and op.average and o.size:
            with np.errstate(all="ignore"):
                np.divide(o, p, out=o)
        results.append(o)
    if table.rooted and not table.reduces and xs[root] is None:
        raise ValueError("with data: the root needs an input")
    want = table.reference(xs, op=op if table.reduces else None, root=root, counts=counts)
    for r in range(p):
        w, got = want[r], results[r]
        if w is None:
            results[r] = None
            continue
        w = np.asarray(w).reshape(-1)
        if got is None or got.shape != w.shape:
            raise SimCheckError(f"{collective}: rank {r} has no output of {w.size} elements")
        exact = got.dtype.kind in "biu" or op.name in ("min", "max", "minimum", "maximum")
        ok = np.array_equal(got, w) if exact else np.allclose(got, w, rtol=1e-5, atol=1e-6)
        if not ok:
            bad = int(np.flatnonzero(got != w)[0]) if got.size else 0
            raise SimCheckError(
                f"{collective}: rank {r} OUT[{bad}] = {got[bad]!r}, expected {w[bad]!r}"
            )
    if table.reduces and table.replicated:
        first = results[0]
        for r in range(1, p):
            if not np.array_equal(results[r], first):  # type: ignore[arg-type]
                raise SimCheckError(f"{collective}: rank {r}'s result differs from rank 0's")
    return results
