"""Every rank's schedule, flattened into integer lists that the engine indexes by step number.

A :class:`Program` numbers the steps of all ranks together (every rank's
first step, then every rank's second, …: the *global step id*; a rank's own
steps keep their order) and keeps, per step, what the
simulation needs: kind, peer, bytes, owner, number of dependencies, the
dependents (compressed rows, as global ids) and, for a send, the global id
of its matching receive. Matching is the executor's rule (the k-th send from
a to b meets the k-th receive at b from a, i.e. equal ``tag``) and is done
with one sort of integer keys.

It is built from :class:`~plait.schedule.ir.Schedule` objects (to move
real data, or schedules made by hand), or from what the builder recorded, read
as columns (:meth:`~plait.schedule.builder.Builder.columns`: the same steps,
without making a ``Step`` object for each; Note [recorded rows]), by
:func:`build_program`; for big jobs in worker processes, since building the
schedules of thousands of ranks costs as much as simulating them: the workers
run the builder on every core and send back arrays.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

import numpy as np

from plait.algos._registry import AlgorithmSpec, build_schedule, get
from plait.schedule.builder import Context, Fabric, HostLayout, record_columns
from plait.schedule.ir import Buf, Region, Schedule, StepKind

__all__ = ["Program", "build_program", "compile_schedules", "describe", "no_gc"]

SEND, RECV, RECV_REDUCE, COPY, REDUCE, POST, GET, GET_REDUCE, WAIT = (int(k) for k in StepKind)
assert list(StepKind) == list(range(9)), "the engine's kinds are these nine"

_NO_REGION = Region(Buf.IN, 0, 0)  # the "region" of a POST or WAIT: no elements

_TAG_BITS = 24


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (and restore its state after).

    Building and simulating allocate millions of small containers and create
    no reference cycles, so the collector's repeated scans of them are pure
    overhead: pausing it makes both about twice as fast.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class Program:
    """All ranks' steps as flat lists (see the module docstring).

    Attributes:
        size: number of ranks.
        local: per global step, its index in its rank's schedule.
        kind, peer, tag, nbytes, owner, n_deps: per global step.
        dep_ptr, dep_idx: step g's dependents are ``dep_idx[dep_ptr[g]:dep_ptr[g+1]]``.
        match: for a send, the global id of its receive; -1 for other steps.
        schedules: the schedules it came from (needed to move real data), if built here.
        one_sided: whether any step is one-sided (``POST``, ``GET``, ``GET_REDUCE``,
            ``WAIT``; their ``tag`` is the phase, their ``peer`` the poster).
        mixed: whether it has one-sided steps and messages both (a host-aware
            algorithm's schedules: Note [mixed schedules] in :mod:`plait.schedule.ir`);
            the engine charges each kind as it would alone.
    """

    size: int
    local: np.ndarray
    kind: list[int]
    peer: list[int]
    tag: list[int]
    nbytes: list[int]
    owner: list[int]
    n_deps: list[int]
    dep_ptr: list[int]
    dep_idx: list[int]
    match: list[int]
    schedules: Sequence[Schedule] | None = None
    one_sided: bool = False
    mixed: bool = False

    @property
    def n_steps(self) -> int:
        """Steps of all ranks together."""
        return len(self.kind)


def _rank_arrays(s: Schedule) -> tuple[list[int], ...]:
    """(kind, peer, tag, count, n_deps, dependents lengths, dependents) of one schedule."""
    steps = s.steps
    return (
        [int(st.kind) for st in steps],
        [st.peer for st in steps],
        [st.tag for st in steps],
        [(st.src or st.dst or _NO_REGION).count for st in steps],
        list(s.n_deps),
        [len(d) for d in s.dependents],
        list(chain.from_iterable(s.dependents)),
    )


def _pack(parts: list[tuple[list[int], ...]]) -> tuple[np.ndarray, ...]:
    """Concatenate per-rank lists into arrays, plus the per-rank step counts."""
    cols = list(zip(*parts, strict=True))
    dtypes = (np.int8, np.int32, np.int32, np.int64, np.int32, np.int32, np.int32)
    out = tuple(
        np.fromiter(chain.from_iterable(c), dtype=dt, count=sum(map(len, c)))
        for c, dt in zip(cols, dtypes, strict=True)
    )
    return (*out, np.array([len(k) for k in cols[0]], dtype=np.int64))


def _pack_columns(parts: list[tuple[Sequence[Any], ...]]) -> tuple[np.ndarray, ...]:
    """:func:`_pack` of ranks recorded as :meth:`Builder.columns`: (kind, peer, tag, count,
    deps) per rank, the dependents derived here (Note [recorded rows] in
    :mod:`plait.schedule.builder`).

    A step's dependents are the later steps that list it in their ``deps``, in
    increasing order, as :meth:`Builder.build` derives them: a stable sort of
    the (dependency, step) pairs by dependency, which keeps the steps in order.
    """
    lengths = np.array([len(c[0]) for c in parts], dtype=np.int64)
    n = int(lengths.sum())

    def flat(i: int, dtype: type) -> np.ndarray:
        return np.fromiter(chain.from_iterable(c[i] for c in parts), dtype=dtype, count=n)

    deps = [c[4] for c in parts]
    n_deps = np.fromiter(chain.from_iterable(map(len, d) for d in deps), np.int32, count=n)
    edges = int(n_deps.sum())
    dep_of = np.fromiter(  # each pair's dependency, as the rank's own step index
        chain.from_iterable(chain.from_iterable(d) for d in deps), np.int64, count=edges
    )
    base = np.zeros(len(parts), dtype=np.int64)  # each rank's first step, counting all ranks
    np.cumsum(lengths[:-1], out=base[1:])
    step = np.repeat(np.arange(n, dtype=np.int64), n_deps)  # each pair's dependent step
    rank_base = np.repeat(np.repeat(base, lengths), n_deps)
    order = np.argsort(dep_of + rank_base, kind="stable")
    dep_len = np.bincount(dep_of + rank_base, minlength=n).astype(np.int32)
    dep_loc = (step[order] - rank_base[order]).astype(np.int32)
    kind = np.fromiter(map(int, chain.from_iterable(c[0] for c in parts)), np.int8, count=n)
    peer, tag, count = flat(1, np.int32), flat(2, np.int32), flat(3, np.int64)
    return kind, peer, tag, count, n_deps, dep_len, dep_loc, lengths


def _assemble(
    p: int,
    arrays: Sequence[tuple[np.ndarray, ...]],
    itemsize: int,
    schedules: Sequence[Schedule] | None,
) -> Program:
    kind, peer, tag, count, n_deps, dep_len, dep_loc, lengths = (
        np.concatenate(col) if len(arrays) > 1 else col[0] for col in zip(*arrays, strict=True)
    )
    n = int(lengths.sum())
    base = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(lengths, out=base[1:])
    owner = np.repeat(np.arange(p, dtype=np.int64), lengths)
    # Dependents as global ids: local index + the owner's base.
    dep_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(dep_len, out=dep_ptr[1:])
    dep_idx = dep_loc.astype(np.int64) + np.repeat(base[:-1][owner], dep_len)
    # Match sends with receives on (src, dst, tag); a one-sided step's tag is a phase.
    one_sided = kind >= POST
    if n and int(tag[~one_sided].max(initial=0)) >= 1 << _TAG_BITS:
        raise ValueError(f"more than 2**{_TAG_BITS} messages between one pair of ranks")
    peer64 = peer.astype(np.int64)
    tag64 = tag.astype(np.int64)
    sends = np.flatnonzero(kind == SEND)
    recvs = np.flatnonzero((kind == RECV) | (kind == RECV_REDUCE))
    windowed = bool(one_sided.any())
    skey = (owner[sends] * p + peer64[sends]) << _TAG_BITS | tag64[sends]
    rkey = (peer64[recvs] * p + owner[recvs]) << _TAG_BITS | tag64[recvs]
    so = np.argsort(skey, kind="stable")
    ro = np.argsort(rkey, kind="stable")
    if len(so) != len(ro) or not np.array_equal(skey[so], rkey[ro]):
        _unmatched(skey, rkey, sends, recvs, owner, base, p)
    match = np.full(n, -1, dtype=np.int64)
    match[sends[so]] = recvs[ro]
    bad = np.flatnonzero(count[sends[so]] != count[recvs[ro]])
    if len(bad):
        g = int(sends[so][bad[0]])
        r = int(owner[g])
        raise RuntimeError(
            f"rank {r} step {g - int(base[r])}: message to rank {int(peer[g])} #{int(tag[g])} "
            f"sends {int(count[g])} elements, the receive expects {int(count[match[g]])}"
        )
    # Renumber the steps interleaved: every rank's step 0, then every rank's step 1, ...
    # Ranks move through their schedules at about the same pace, so the steps that the
    # engine handles together sit together in memory (rank-major ids scatter them over
    # gigabytes at 10^6 steps and make every step a cache miss). Each rank's own steps
    # keep their order, which is all the simulation's results depend on.
    local = np.arange(n, dtype=np.int64) - np.repeat(base[:-1], lengths)
    order = np.lexsort((owner, local))
    new_id = np.empty(n, dtype=np.int64)
    new_id[order] = np.arange(n, dtype=np.int64)
    lens = dep_len[order].astype(np.int64)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    where = np.repeat(dep_ptr[:-1][order] - ptr[:-1], lens) + np.arange(int(ptr[-1]))
    matched = match[order]
    matched[matched >= 0] = new_id[matched[matched >= 0]]
    return Program(
        size=p,
        local=local[order],
        kind=kind[order].tolist(),
        peer=peer[order].tolist(),
        tag=tag[order].tolist(),
        nbytes=(count[order] * itemsize).tolist(),
        owner=owner[order].tolist(),
        n_deps=n_deps[order].tolist(),
        dep_ptr=ptr.tolist(),
        dep_idx=new_id[dep_idx[where]].tolist(),
        match=matched.tolist(),
        schedules=schedules,
        one_sided=windowed,
        mixed=windowed and len(sends) > 0,
    )


def describe(prog: Program, g: int) -> str:
    """Global step ``g`` in words (for reports)."""
    k, q, tag, nbytes = StepKind(prog.kind[g]), prog.peer[g], prog.tag[g], prog.nbytes[g]
    if k in (StepKind.SEND, StepKind.RECV, StepKind.RECV_REDUCE):
        return f"{k.name.lower()} with rank {q} #{tag}, {nbytes} B"
    if k is StepKind.POST:
        return f"post phase {tag}"
    if k is StepKind.WAIT:
        return f"wait for rank {q} phase {tag}"
    if k in (StepKind.GET, StepKind.GET_REDUCE):
        return f"{k.name.lower()} from rank {q} phase {tag}, {nbytes} B"
    return f"{k.name.lower()}, {nbytes} B"


def _unmatched(
    skey: np.ndarray,
    rkey: np.ndarray,
    sends: np.ndarray,
    recvs: np.ndarray,
    owner: np.ndarray,
    base: np.ndarray,
    p: int,
) -> None:
    only_send = np.setdiff1d(skey, rkey)
    if len(only_send):
        k = int(only_send[0])
        what = "send {}->{} #{} has no receive"
    else:
        k = int(np.setdiff1d(rkey, skey)[0])
        what = "receive of {}->{} #{} has no send"
    pair, tag = k >> _TAG_BITS, k & ((1 << _TAG_BITS) - 1)
    raise RuntimeError(what.format(pair // p, pair % p, tag))


def compile_schedules(schedules: Sequence[Schedule], itemsize: int) -> Program:
    """The :class:`Program` of ``schedules`` (one per rank, rank order).

    With a fabric, its switches' schedules follow the ranks' (their ``rank`` is
    at least their ``size``), and the program has one participant per schedule.
    """
    for r, s in enumerate(schedules):
        if s.rank != r or not s.size <= len(schedules):
            raise ValueError(f"schedule {r} is rank {s.rank} of {s.size}, not of {len(schedules)}")
    return _assemble(
        len(schedules), [_pack([_rank_arrays(s) for s in schedules])], itemsize, schedules
    )


# -- building in worker processes ----------------------------------------------------------


def _build_chunk(args: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
    """Worker: record ranks ``lo..hi-1`` and return their arrays."""
    (
        collective,
        algorithm,
        p,
        count,
        itemsize,
        root,
        segment,
        commutative,
        hosts,
        fabric,
        counts,
        window,
        lo,
        hi,
    ) = args
    spec = get(collective, algorithm)
    layout = HostLayout(hosts) if hosts is not None else None
    ctx = Context(
        collective,
        0,
        p,
        count,
        itemsize,
        commutative,
        root,
        segment,
        layout,
        fabric,
        counts,
        window,
    )
    with no_gc():
        return _record(spec, ctx, lo, hi)


def _record(spec: AlgorithmSpec, ctx: Context, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """Ranks ``lo..hi-1`` of ``ctx``'s call recorded as columns (no ``Step`` objects; each
    schedule is used once, so no cache either), packed."""
    return _pack_columns([record_columns(spec.build, ctx.with_rank(r)) for r in range(lo, hi)])


#: Jobs with at least this many ranks are built in worker processes (when allowed).
PARALLEL_RANKS = 512


def default_workers() -> int:
    """Worker processes :func:`build_program` uses: every core, if forking is safe here."""
    if not hasattr(os, "fork") or threading.active_count() > 1 or "jax" in sys.modules:
        # Forking a process with threads can deadlock the child (and newer Pythons warn);
        # JAX runs threads of its own that Python does not count, and warns at every fork.
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def build_program(
    collective: str,
    algorithm: str,
    p: int,
    count: int,
    *,
    itemsize: int,
    root: int = 0,
    segment: int = 0,
    commutative: bool = True,
    hosts: HostLayout | None = None,
    fabric: Fabric | None = None,
    workers: int | None = None,
    keep_schedules: bool = False,
    counts: tuple[int, ...] | None = None,
    window: int = 0,
) -> Program:
    """Build every rank's schedule and compile them into a :class:`Program`.

    With ``workers > 1`` (default: :func:`default_workers` for jobs of at least
    :data:`PARALLEL_RANKS` ranks) the ranks are split among forked worker
    processes; a process that runs other threads builds here instead, since
    forking it could deadlock the children. Either way the ranks are recorded as
    columns, without ``Step`` objects, unless ``keep_schedules`` (needed to move
    real data): then they are built here, through the builder's cache, and the
    program keeps the schedule objects. With a ``fabric`` its switches get
    schedules too, after the ranks.
    ``counts``: an uneven collective's per-rank counts (``Context.counts``);
    ``window``: the bytes of shared window each rank may use (``Context.window``).
    """
    spec = get(collective, algorithm)
    ctx = Context(
        collective,
        0,
        p,
        count,
        itemsize,
        commutative,
        root,
        segment,
        hosts,
        fabric,
        counts,
        window,
    )
    n = ctx.participants
    if workers is None:
        workers = default_workers() if p >= PARALLEL_RANKS else 1
    elif workers > 1 and default_workers() == 1:
        workers = 1
    if keep_schedules:
        with no_gc():
            schedules = [build_schedule(spec, ctx.with_rank(r)) for r in range(n)]
            return compile_schedules(schedules, itemsize)
    if workers <= 1 or n < 2 * workers:
        with no_gc():
            return _assemble(n, [_record(spec, ctx, 0, n)], itemsize, None)
    host_tuple = hosts.hosts if hosts is not None else None
    chunks = 4 * workers  # smaller pieces balance ranks whose schedules differ in length
    bounds = [n * i // chunks for i in range(chunks + 1)]
    common = (collective, algorithm, p, count, itemsize, root, segment, commutative)
    jobs = [
        (*common, host_tuple, fabric, counts, window, lo, hi)
        for lo, hi in pairwise(bounds)
        if hi > lo
    ]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        arrays = pool.map(_build_chunk, jobs, chunksize=1)
    return _assemble(n, arrays, itemsize, None)
