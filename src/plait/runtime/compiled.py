"""The compiled form of a one-sided schedule: its operations, and a function that runs them.

A small one-sided call (:mod:`plait.runtime.one_sided`) is a few copies, reductions,
posts and reads of a peer's counter, each of a few bytes; what it costs is the Python
around them. So each schedule is turned, once per window, dtype and half of the window,
into a list of operations (:class:`Compiled`, Note [compiled one-sided schedules]) and
that list into the source of one Python function, which runs them in a straight line
(Note [generated runs]), or loops over the pieces of a large call (Note [rolled pieces]
in :mod:`plait.runtime.operations`, where the operations' codes and fields are).

Note [compiled one-sided schedules]
    A small call is a few steps, and reading a step's fields, slicing the
    window and looking its views up cost more than the copies themselves. So
    each schedule is compiled once per (window, dtype) into two lists of
    operations, one per half of the window (:class:`Compiled`), whose window
    regions are numpy views made in advance. An operation names its operands
    by their place in one list: the caller's buffers, the regions of them
    that are not a whole ``IN`` or ``OUT`` (sliced once per call however many
    operations use them), then the views. An operation on
    a peer keeps the peer's :meth:`~plait.transport.window.Window.probe`, so
    that its counter and digest word are read in place, one subscript each
    (the digest every time: that costs less than remembering which peers
    were checked). The compiled
    form is the schedule's steps in order, with nothing added or dropped but
    one thing: a copy into a region followed at once by a reduction into the
    same region from a peer (``COPY`` then ``GET_REDUCE``), or a read from a
    peer followed by a local reduction into it (``GET`` then ``REDUCE``), is
    one *fold*, ``ufunc(x, y, out=dst)`` with the operands in the steps'
    order: the same bits (numpy's complex multiply is the one ufunc seen to
    round otherwise with ``out`` apart from its inputs, and is not used: Note
    [complex products] in plait.ops), one pass over the region instead of two (at 4 MiB
    on 2 ranks, a fifth of the bytes the call moves) and one operation fewer.
    Nobody sees the region between the two steps: peers read this rank's
    window only after a ``POST``, and none comes between them. With
    PLAIT_TIMELINE the steps run one by one instead, to be reported. Steps
    between the caller's buffers are compiled like the others, and skipped
    where :func:`~plait.runtime.executor.run_local` skips them: a copy of a
    region onto itself is left out, and a copy from ``IN`` to ``OUT`` at equal
    offsets is skipped by an in-place call (the two are one memory).

Note [generated runs]
    Interpreting the operations in a loop (read an operation's code, branch on
    it, make the list of its operands, look them up) cost about as much as the
    operations of an 8-byte call themselves. So :func:`_generate` writes the
    whole call out as the source of one function: each half's operations in
    their order (the half is chosen by one branch), with the operands as
    names: the caller's buffers ``inp``, ``out`` and ``tmp``, regions of them
    sliced at the top (``r3``, ...), and the window's views, probes and peers
    bound as names of the function's own globals (``c5_0``, ``k0_1``, ...). It
    runs a call as one frame with no loop and no branch but the waits': a wait
    reads the peer's counter, polls it (Note [a second look]) and checks its
    digest inline, and calls :func:`_peer` only where that fails. Every value
    that differs from one size, rank or window to the next is such a name, so
    one source serves all the calls of one kind and is compiled once
    (:func:`compile`; 0.5 ms for a 2-rank allreduce, 15 ms for a 33-rank one
    of 100 operations), and a call of a new size only binds the names again
    (0.05-0.8 ms). That holds for a call of one piece as written; a call of
    many pieces has as many operations, and its run loops over them (Note
    [rolled pieces] in :mod:`plait.runtime.operations`), so that its source
    does not grow with them either. It does what the operations say, in
    their order, and nothing else (``tests/unit/test_arena.py`` runs every
    kind of operation against what its steps say, with a reduction whose
    operands' order shows in the bits; ``tests/unit/test_rolled_pieces.py``,
    every one-sided algorithm's loop against its operations written out).
    A window keeps the compiled calls of at most 256 schedules and
    :data:`KEPT_STEPS` steps, and the sources compiled are at most 256 and
    16 MiB in all: a loop over ever new sizes holds no more.

    The call around the operations is in the function too, since its frames
    and method calls cost as much again as the operations of a small call:
    the begin (:meth:`~plait.transport.window.Window.begin`: each peer's
    counter read in place, this rank's digest word written in place; where a
    peer has not ended call ``epoch - 2``, the window's begin and its wait,
    :func:`~plait.runtime.posts.begin_call`), each post in place where the
    window says how (:meth:`~plait.transport.window.Window.poster`: the
    store, the fence and a look at the peers' sleeping flags; ``post`` itself
    only for a sleeper), the window's ``end``, and the failure: settled and
    posted as given up (:func:`~plait.runtime.posts.failed`). Its caller
    passes the call's numbers and a ``make`` for its
    :class:`~plait.runtime.executor.Call`, which only a slow way (a wait, a
    begin that waits, a failure) asks for: a call that waits for nobody makes
    none (a quarter of a 2-rank barrier). It holds no reference to the window
    or the transport (they are passed in, so that the window's cache of
    compiled forms makes no cycle), and its code is filed under this
    package's folder, so that the flight recorder's walk to the caller's
    frame passes over it like any frame of plait. Measured against the loop
    in the same processes: 0.4-0.6 µs less of a 2-rank 8-byte call (7-10 %);
    the call around it in the function, a further 0.6-1.0 µs (docs/performance.md).

Note [a second look]
    Ranks that run a loop of small calls arrive at each wait nearly together, and a
    peer's post is often a fraction of a microsecond away when a rank first reads its
    counter. The way into :meth:`~plait.transport.window.Window.wait` (probes, deadline,
    the look for a peer that gave up) costs a few microseconds of Python, and the rank
    that pays them arrives late at the next call, where its peer then waits for it: with
    2 ranks about a third of the calls waited so. So a compiled wait reads the counter
    again in place up to ``window.polls`` times before it waits the whole way; that is 0
    (wait at once) where the ranks share cores or are threads of one process, or the
    thread must not spin, since reading on there keeps the peer from running. Where
    ranks outnumber cores, the peer is often one that shares this rank's core and runs
    only once this rank lets it: the wait gives the core up (``os.sched_yield``) and
    reads again, up to ``window.yields`` times, before it waits the whole way. Through
    the window's wait, a rank spends a few microseconds of Python before its first
    yield and after its last, and often goes to sleep and must be woken; with 4 ranks
    on 2 cores, that made most calls the slowest rank's sleep (docs/performance.md).
    The yields are in the generated function too, before the call's ``Call`` is made
    and :func:`_peer` called: with 4 ranks on 2 cores most waits end after a yield or
    two, and each had paid for a ``Call`` and a frame it never used (an 8-byte
    allreduce in ``plait bench``: 21.6-23.2 µs against 24.8-27.5, docs/performance.md,
    "an eighth time").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

import numpy as np

from plait.errors import CommError, InternalError
from plait.ops import fold_one
from plait.runtime.executor import Call
from plait.runtime.operations import (
    _COPY,
    _FOLD,
    _GET,
    _GET_REDUCE,
    _POST,
    _REDUCE,
    _SELF_COPY,
    _WAIT,
    WRITTEN_OUT,
    Shapes,
    operands,
    phase_of,
    rows,
    stretches,
)
from plait.runtime.posts import (
    GAVE_UP_FROM,
    await_post,
    begin_call,
    check_peer,
    failed,
    give_up,
)
from plait.schedule.ir import SHARED, Region, Schedule, Step, StepKind
from plait.transport.window import MASK64

__all__ = ["Compiled", "compiled_for", "run_of"]


def compiled_for(schedule: Schedule, window: Any, dtype: np.dtype) -> Compiled:
    """The schedule's call on ``window`` for ``dtype`` (made once, then cached)."""
    cache: _Kept
    try:
        cache = window.compiled
    except AttributeError:
        cache = window.compiled = _Kept(256, KEPT_STEPS)
    hit = cache.get((id(schedule), dtype))
    if hit is not None and hit[0] is schedule:
        found: Compiled = hit[1]
        return found
    window.reserve(schedule.shared_count * dtype.itemsize)  # a group's window grows here
    made = _compile(schedule, window, dtype)
    # Kept with its schedule, so that the id is its own; weighed by its steps.
    cache.keep((id(schedule), dtype), (schedule, made), len(schedule.steps))
    return made


#: The steps of the schedules whose compiled forms a window keeps, in all (with their
#: operations, views and loops' tables, 0.9-1.3 KB a step: a 64 MiB allreduce on 2 ranks
#: has 392 steps, one of 2 GiB 12,296). A schedule of more is kept alone.
KEPT_STEPS = 1 << 16


class _Kept(dict[Any, Any]):
    """A cache that forgets all it holds where one more entry would make more than
    ``most`` entries, or more than ``heaviest`` of their weights in all."""

    def __init__(self, most: int, heaviest: int) -> None:
        super().__init__()
        self.most, self.heaviest, self.weight = most, heaviest, 0

    def keep(self, key: Any, value: Any, weight: int) -> None:
        """``self[key] = value``, which weighs ``weight``."""
        if len(self) >= self.most or self.weight + weight > self.heaviest:
            self.clear()
        self[key] = value
        self.weight += weight

    def clear(self) -> None:
        """Forget all, and their weights."""
        super().clear()
        self.weight = 0


def run_of(schedule: Schedule, window: Any, dtype: np.dtype) -> Callable[..., None]:
    """The generated call of ``schedule`` on ``window`` (Note [generated runs]): a loop
    repeats one call, whose run is the window's last (a dtype is one object per kind;
    another object of an equal dtype looks it up).

    Raises:
        CommError: the transport closed (the window's memory is released).
    """
    last = getattr(window, "last_compiled", None)
    if last is not None and last[0] is schedule and last[1] is dtype:
        run: Callable[..., None] = last[2]
        return run
    run = compiled_for(schedule, window, dtype).run
    window.last_compiled = (schedule, dtype, run)
    return run


class Compiled(NamedTuple):
    """A schedule's compiled operations for each half of a window (Note [compiled
    one-sided schedules]), and the call that runs them (Note [generated runs]).

    ``ops``: each half's operations; an operand is a place in one numbering, first
    the caller's buffers ``IN``, ``OUT`` and ``TMP`` (a region that is all of ``IN``
    or ``OUT`` is the buffer itself), then its other regions, then the window's
    views. ``run``: the whole call as one function, called as ``run(inp, out, tmp,
    aliased, epoch, seq, slot, make, key, window, transport)``: ``key`` has the
    call's ``check`` and ``ufunc``, and ``make(key, epoch, seq, slot)`` gives the
    call's :class:`~plait.runtime.executor.Call` where a slow way needs it.
    """

    ops: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]
    run: Callable[..., None]


def _compile(schedule: Schedule, window: Any, dtype: np.dtype) -> Compiled:
    """Both halves' operations, and the call that runs them."""
    ops0, regions, views0 = _operations(schedule, window, dtype, 0)
    ops1, _, views1 = _operations(schedule, window, dtype, 1)  # the same regions
    counts = (schedule.in_count, schedule.out_count)
    run = _generate(schedule, window, (ops0, ops1), regions, (views0, views1), counts)
    return Compiled((ops0, ops1), run)


def _operations(
    schedule: Schedule, window: Any, dtype: np.dtype, half: int
) -> tuple[list[tuple[Any, ...]], tuple[tuple[int, int, int], ...], tuple[np.ndarray, ...]]:
    """One half's operations, the caller's regions they name and the window's views."""
    rank = schedule.rank
    mine = window.typed(rank, half, dtype)
    regions: dict[tuple[int, int, int], int] = {}
    views: list[np.ndarray] = []

    def operand(r: Region | np.ndarray) -> int:
        # A region of this rank's window or a peer's view: a constant; of IN/OUT/TMP: a
        # region of the caller's buffers. Numbered apart here, renumbered at the end.
        if isinstance(r, np.ndarray):
            views.append(r)
            return -len(views)
        if r.buf is SHARED:
            views.append(mine[r.offset : r.end])
            return -len(views)
        b = int(r.buf)
        if b < 2 and r.offset == 0 and r.count == schedule.buffer_count(r.buf):
            return b  # all of IN or OUT
        key = (b, r.offset, r.end)
        if key not in regions:
            regions[key] = 3 + len(regions)
        return regions[key]

    ops: list[tuple[Any, ...]] = []
    prev: Step | None = None  # the step of ops[-1] while it may fuse with the next
    prev_src = 0  # its source operand
    for step in schedule.steps:
        kind, s, d = step.kind, step.src, step.dst
        if kind is StepKind.POST:
            ops.append((_POST, step.tag))
        elif kind is StepKind.WAIT:
            q = step.peer
            ops.append((_WAIT, 0, 0, False, q, step.tag, (q,), window.probe(q, half)))
        elif s is None or d is None:
            raise InternalError(f"rank {rank}: {step!r} lacks a region a {kind.name} step needs")
        elif kind is StepKind.COPY or kind is StepKind.REDUCE:
            if kind is StepKind.REDUCE and _follows(prev, StepKind.GET, d):
                # dst = theirs, then dst = src ∘ dst (first) or dst ∘ src: one fold.
                own = operand(s)
                x, y = (own, prev_src) if step.first else (prev_src, own)
                q = prev.peer
                ops[-1] = (_FOLD, x, operand(d), y, q, prev.tag, (q,), window.probe(q, half))
                prev = None
                continue
            code = _COPY if kind is StepKind.COPY else _REDUCE
            if code == _COPY and s.buf is not SHARED and d.buf is not SHARED:
                if s.offset == d.offset and s.buf == d.buf:
                    prev = None  # a copy onto itself: nothing to do
                    continue
                if s.offset == d.offset and s.buf + d.buf == 1:
                    code = _SELF_COPY  # IN to OUT or OUT to IN: one memory in place
            prev_src = operand(s)
            ops.append((code, prev_src, operand(d), step.first))
        else:
            q = step.peer
            theirs = operand(window.typed(q, half, dtype)[s.offset : s.end])
            probe = window.probe(q, half)
            if kind is StepKind.GET_REDUCE and _follows(prev, StepKind.COPY, d):
                # dst = src, then dst = theirs ∘ dst (first) or dst ∘ theirs: one fold.
                x, y = (theirs, prev_src) if step.first else (prev_src, theirs)
                ops[-1] = (_FOLD, x, operand(d), y, q, step.tag, (q,), probe)
                prev = None
                continue
            code = _GET if kind is StepKind.GET else _GET_REDUCE
            prev_src = theirs
            ops.append((code, theirs, operand(d), step.first, q, step.tag, (q,), probe))
        prev = step if kind is StepKind.COPY or kind is StepKind.GET else None
    # The views follow the caller's buffers and regions in a call's operand list: view -k
    # sits at n + k - 1.
    n = 3 + len(regions)

    def at(k: Any) -> Any:
        return n - 1 - k if type(k) is int and k < 0 else k

    for i, op in enumerate(ops):
        if op[0] == _FOLD:  # two operands and a destination
            ops[i] = (op[0], at(op[1]), at(op[2]), at(op[3]), *op[4:])
        elif op[0] != _POST:
            ops[i] = (op[0], at(op[1]), at(op[2]), *op[3:])
    return ops, tuple(regions), tuple(views)


def _follows(prev: Step | None, kind: StepKind, dst: Region) -> TypeGuard[Step]:
    """Whether ``prev``, the step just compiled, is a ``kind`` step into ``dst`` that the
    next step may join into one fold (Note [compiled one-sided schedules])."""
    return prev is not None and prev.kind is kind and prev.dst == dst and prev.src is not None


# -- the operations as one function --------------------------------------------------------------

_BUFFERS = ("inp", "out", "tmp")
# Generated code is filed under the package's folder (Note [generated runs]).
_FILENAME = str(Path(__file__).resolve().parent / "<compiled one-sided schedule>")


def _generate(
    schedule: Schedule,
    window: Any,
    ops: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]],
    regions: tuple[tuple[int, int, int], ...],
    consts: tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]],
    counts: tuple[int, int],
) -> Callable[..., None]:
    """The function that runs a call of ``schedule`` on ``window`` (Note [generated runs])."""
    rank = schedule.rank
    size = getattr(window, "size", schedule.size)
    env: dict[str, Any] = {
        "_peer": _peer,
        "_yield": os.sched_yield,
        "_wrong": _wrong_counts,
        "_begin": begin_call,
        "_failed": failed,
        "_give_up": give_up,
        "CommError": CommError,
        "schedule": schedule,
    }
    head = ["def run(inp, out, tmp, aliased, epoch, seq, slot, make, key, window, transport):"]
    # Begin (Window.begin, inline): every peer has ended call epoch - 2, which used this
    # half; this rank's digest word for the half says which call it is in.
    _, _, env["own"], own = window.probe(rank, 0)
    ended: list[str] = []
    for q in range(size):
        if q != rank:
            env[f"e{q}"], i, _, _ = window.probe(q, 0)
            ended.append(f"e{q}[{int(i)}] >= need")
    head += [
        "    call = None",
        "    check = key.check",
        "    base = epoch << 32",
        "    half = epoch & 1",
        "    try:",
        f"        need = base - {1 << 32}",
        "        go = need <= 0" + (f" or ({' and '.join(ended)})" if ended else ""),
        "        if go:",
        f"            own[{int(own)} + half] = check & {MASK64}",
        "    except (TypeError, ValueError):  # released: the slow way says why",
        "        go = False",
        "    if not go:",
        "        call = make(key, epoch, seq, slot)",
        "        half = _begin(window, transport, call, schedule)",
        "    try:",
    ]
    if any(op[0] not in (_POST, _WAIT) for op in ops[0]):
        env["n_in"], env["n_out"] = counts
        head.append("        if inp.size != n_in or out.size != n_out:")
        head.append(
            "            raise _wrong(schedule, make(key, epoch, seq, slot), inp, out, n_in, n_out)"
        )
    # Each operand's element count, for the folds of one element (Note [one-element folds]
    # in plait.ops): the caller's buffers, then their regions; the views have their own.
    sizes = [schedule.in_count, schedule.out_count, schedule.tmp_count]
    sizes += [hi - lo for _, lo, hi in regions]
    shapes = [Shapes(regions, sizes, consts[h]) for h in (0, 1)]
    parts = [
        stretches([shapes[h].of(op) for op in ops[h]], (_POST,), WRITTEN_OUT)
        if len(ops[h]) > WRITTEN_OUT
        else [(0, len(ops[h]), 0)]
        for h in (0, 1)
    ]
    # The regions that operations written out name are sliced here, numbered from 3 in
    # their order; those of a loop's operations, in the loop (Note [rolled pieces]).
    rolled = any(period for half in parts for _, _, period in half)
    n = len(sizes)
    out = [op for h in (0, 1) for a, b, p in parts[h] if not p for op in ops[h][a:b]]
    kept = sorted({k for op in out for k in operands(op) if 3 <= k < n}) if rolled else range(3, n)
    rename = {k: i for i, k in enumerate(kept, 3)}
    for k, i in rename.items():
        b, lo, hi = regions[k - 3]
        env[f"s{i}"] = slice(lo, hi)
        head.append(f"        r{i} = {_BUFFERS[b]}[s{i}]")
    if any(op[0] in (_REDUCE, _GET_REDUCE, _FOLD) for op in ops[0]):
        head.append("        ufunc = key.ufunc")
    if any(op[0] >= _GET for op in ops[0]):
        head.append(f"        gave_up = base | {GAVE_UP_FROM}")  # from gave_up to ended: it gave up
        head.append(f"        ended = base + {1 << 32}")  # and from here on it ended this call
    post = _post_lines(window, env)
    bodies = [_body(ops[h], parts[h], shapes[h], rename, rolled, h, env, post) for h in (0, 1)]
    head.append("        if half:")
    head += ["    " + line for line in bodies[1] or ["        pass"]]
    head.append("        else:")
    head += ["    " + line for line in bodies[0] or ["        pass"]]
    head += [
        "    except CommError as exc:",
        "        if call is None:",
        "            call = make(key, epoch, seq, slot)",
        "        found = _failed(window, transport, call, schedule, exc)",
        "        if found is exc:",
        "            raise",
        "        raise found from None",
        "    except BaseException:",
        "        _give_up(window, epoch, None)",
        "        raise",
    ]
    if not schedule.last_phase:  # else its posts said it (Note [window reuse])
        head.append("    window.end(epoch)")
    source = "\n".join(head) + "\n"
    made = _CODE.get(source)
    if made is None:
        made = compile(source, _FILENAME, "exec")
        _CODE.keep(source, made, len(source))
    exec(made, env)
    # Out of its own globals: a function in the dict it reads would be a cycle, kept until
    # the collector runs, and with it the window's views (the segments stay mapped).
    run: Callable[..., None] = env.pop("run")
    return run


def _post_lines(window: Any, env: dict[str, Any]) -> list[str]:
    """The lines of a post of ``v`` (Window.post, in place where the window says how:
    :meth:`~plait.transport.window.Window.poster`), their constants bound in ``env``."""
    poster = window.poster() if hasattr(window, "poster") else None
    if poster is None:
        return ["        window.post(v)"]
    env["own_ctr"], i, fence, flags, sleeping = poster
    lines = ["        try:", f"            own_ctr[{int(i)}] = v  # after the half's bytes"]
    if fence is not None:  # store, fence, load: Dekker with a peer going to sleep
        env["fence"] = fence
        lines += ["            fence.acquire()", "            fence.release()"]
    for f, words in enumerate(flags):
        env[f"f{f}"] = words
    asleep = " or ".join(f"f{f}[{int(sleeping)}]" for f in range(len(flags))) or "False"
    lines += [
        f"            woken = {asleep}",
        "        except (TypeError, ValueError):",
        "            woken = True",
        "        if woken:  # a peer may sleep, or the memory is released: the window's post",
        "            window.post(v)",
    ]
    return lines


def _body(
    ops: list[tuple[Any, ...]],
    parts: list[tuple[int, int, int]],
    shapes: Shapes,
    rename: dict[int, int],
    rolled: bool,
    h: int,
    env: dict[str, Any],
    post: list[str],
) -> list[str]:
    """Half ``h``'s operations as lines of the run (at the depth of its ``try``), their
    constants bound in ``env`` under names that end in ``_h``: each stretch of ``parts``
    written out, or a loop over its periods (Note [rolled pieces] in
    :mod:`plait.runtime.repeats`). ``rename``: the name of each region sliced at the top;
    ``rolled``: whether any half loops (then no value that differs with the call's size is
    written in the source); ``post``: the lines of a post of ``v``."""
    n = shapes.n
    views = sorted(
        {k for a, b, p in parts if not p for op in ops[a:b] for k in operands(op) if k >= n}
    )
    numbers = {k: k if not rolled else i for i, k in enumerate(views, 3 + len(rename))}

    def name(k: int) -> str:
        if k < 3:
            return _BUFFERS[k]
        if k < n:
            return f"r{rename[k]}"
        env[f"c{numbers[k]}_{h}"] = shapes.consts[k - n]
        return f"c{numbers[k]}_{h}"

    body: list[str] = []
    m = 0  # the operations' names are numbered in the order they are written
    for lo, hi, period in parts:
        if not period:
            for op in ops[lo:hi]:
                args = [name(k) for k in operands(op)]
                value = phase_of(op)
                phase = str(value)
                if rolled and value is not None:  # the last pieces' phases differ with the size
                    phase = f"z{m}_{h}"
                    env[phase] = value
                one = len(args) > 1 and shapes.one(op[2])
                body += _lines(op, args, one, phase, m, h, env, post)
                m += 1
            continue
        # A loop over the periods: each row of the table holds a period's regions (their
        # slices), views and phases, in the order of its operations.
        loop, top, lines = f"t{m}_{h}", [], []
        names: list[str] = []
        for op in ops[lo : lo + period]:
            args = []
            for k in operands(op):
                j = len(names)
                if k < 3:
                    args.append(_BUFFERS[k])
                    continue
                if k < n:
                    names.append(f"y{j}")
                    top.append(f"            u{j} = {_BUFFERS[shapes.regions[k - 3][0]]}[y{j}]")
                    args.append(f"u{j}")
                else:
                    names.append(f"x{j}")
                    args.append(f"x{j}")
            phase = ""
            if phase_of(op) is not None:
                phase = f"g{len(names)}"
                names.append(phase)
            lines += _lines(op, args, len(args) > 1 and shapes.one(op[2]), phase, m, h, env, post)
            m += 1
        env[loop] = rows(ops, lo, hi, period, shapes)
        body.append(f"        for {', '.join(names)}, in {loop}:")
        body += top + ["    " + line for line in lines]
    return body


def _lines(
    op: tuple[Any, ...],
    args: list[str],
    one: bool,
    phase: str,
    m: int,
    h: int,
    env: dict[str, Any],
    post: list[str],
) -> list[str]:
    """The lines of operation ``op`` (at the depth of the run's ``try``), its peer's
    constants bound in ``env`` under names that end in ``m_h``: ``args``, the names of its
    operands (:func:`_operands`); ``one``, whether its destination is one element;
    ``phase``, its phase or post's value as source."""
    code = op[0]
    if code == _POST:
        return [f"        v = base | {phase}", *post]
    body: list[str] = []
    if code >= _GET:  # the peer's phase first
        q, _, peers, probe = op[4:8]
        counters, i, digests, j = probe
        env[f"q{m}_{h}"], env[f"p{m}_{h}"], env[f"w{m}_{h}"] = q, peers, probe
        env[f"k{m}_{h}"], env[f"d{m}_{h}"] = counters, digests
        # The peer's words, read in place (released, they raise: the slow way says why).
        # Its digest is that of this call from its begin until every rank has ended it.
        ctr = f"k{m}_{h}[{int(i)}]"
        body += [
            f"        need = base | {phase}",
            "        try:",
            f"            v = {ctr}",
            "            if v < need:  # a moment behind, mostly (Note [a second look])",
            "                for _ in range(window.polls):",
            f"                    if (v := {ctr}) >= need:",
            "                        break",
            "                else:  # where ranks outnumber cores: give the core up",
            "                    for _ in range(window.yields):",
            "                        _yield()",
            f"                        if (v := {ctr}) >= need:",
            "                            break",
            f"            go = v >= need and d{m}_{h}[{int(j)}] == check"
            " and not gave_up <= v < ended",
            "        except (TypeError, ValueError):",
            "            go = False",
            "        if not go:",
            "            if call is None:",
            "                call = make(key, epoch, seq, slot)",
            f"            _peer(window, transport, call, schedule, need, q{m}_{h}, p{m}_{h},"
            f" w{m}_{h}, {h})",
        ]
        if code == _WAIT:
            return body
    if code in (_FOLD, _REDUCE, _GET_REDUCE):
        if code == _FOLD:
            x, dst, y = args
            pair = f"{x}, {y}"
        else:
            src, dst = args
            pair = f"{src}, {dst}" if op[3] else f"{dst}, {src}"
        if one:  # Note [one-element folds] in plait.ops
            env["_fold_one"] = fold_one
            body.append(f"        _fold_one(ufunc, {pair}, {dst})")
        else:
            body.append(f"        ufunc({pair}, out={dst})")
    elif code == _SELF_COPY:
        body.append("        if not aliased:")  # IN and OUT are one memory in place
        body.append(f"            {args[1]}[...] = {args[0]}")
    else:  # _COPY, _GET
        body.append(f"        {args[1]}[...] = {args[0]}")
    return body


# The source of a generated run names every value that differs from one size, rank or
# window to the next, so that calls of one kind share its code: compiled once per source.
# At most 256 sources, of 16 MiB in all (a run's code takes about as much again).
_CODE = _Kept(256, 1 << 24)


def _peer(
    window: Any,
    transport: Any,
    call: Call,
    schedule: Schedule,
    need: int,
    q: int,
    peers: tuple[int],
    probe: tuple[Any, int, Any, int],
    half: int,
) -> None:
    """The slow way of a generated run's wait for peer ``q`` to post ``need``: its counter
    was short after the run's polls or yields (Note [a second look]), its digest differs,
    it gave up, or its words are released.

    Waits the whole way where the counter is still short (a wait for a counter that has
    arrived returns at once), then checks the peer's call (Note [one-sided] in
    :mod:`plait.runtime.one_sided`).
    """
    counters, i, digests, j = probe
    # The recorder's slot says whom the call waits for; a failure leaves it for the dump.
    slot = call.slot
    if slot is not None:
        slot.peers = peers
    await_post(window, transport, q, need, call, schedule, q)
    base = need & ~0xFFFFFFFF
    try:
        suspect = digests[j] != call.check or base | GAVE_UP_FROM <= counters[i] < base + (1 << 32)
    except (TypeError, ValueError):
        suspect = True
    if suspect:
        check_peer(window, q, half, call, schedule.rank)  # raises what the peer did
    if slot is not None:
        slot.peers = ()


def _wrong_counts(
    schedule: Schedule, call: Call, inp: np.ndarray, out: np.ndarray, n_in: int, n_out: int
) -> InternalError:
    return InternalError(
        f"rank {schedule.rank}: {call.describe}: buffers of {inp.size} and {out.size} elements "
        f"for a schedule made for {n_in} and {n_out}"
    )
