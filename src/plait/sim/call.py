"""One simulated call: build every rank's schedule, run the engine, report a :class:`Result`.

:func:`simulate` is the entry point of :mod:`plait.sim` (whose docstring
describes the model); :func:`build_all` gives the schedules it runs and
:func:`simulate_schedules` times schedules made by hand. The call's sizes
come from the table of collectives (:mod:`plait.collectives`): ``nbytes`` is
the whole buffer, as nccl-tests and ``plait bench`` count it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait import algos as _algos  # noqa: F401  (registers every algorithm)
from plait.algos._registry import SEGMENT_BYTES, build_schedule, get
from plait.collectives import BLOCK_COLLECTIVES
from plait.collectives import get as _collective
from plait.ops import SUM, Op
from plait.schedule.builder import Context
from plait.schedule.ir import Schedule
from plait.sim.data import check, input_arrays, start_buffers
from plait.sim.engine import Outcome, StepRecord, run, run_schedules
from plait.sim.network import Network
from plait.sim.program import build_program

__all__ = [
    "BLOCK_COLLECTIVES",
    "MAX_BYTES",
    "Result",
    "build_all",
    "context_count",
    "simulate",
    "simulate_schedules",
]


@dataclass
class Result:
    """The outcome of one simulated call.

    Attributes:
        collective, algorithm: what ran.
        size: number of ranks.
        count: ``Context.count`` of the call (elements; per-rank block for block collectives).
        nbytes: the collective's whole buffer in bytes (as in ``plait bench``).
        itemsize: bytes per element.
        time: seconds until the last rank finished.
        finish: per rank, when its last step finished.
        link_bytes: bytes that crossed each link of ``network`` (index = link index).
        network: the network it ran on.
        steps, messages, events: sizes of the simulation.
        build_seconds, sim_seconds: wall time spent building schedules and simulating.
        records: per-step timings when run with ``trace=True`` (see :func:`write_trace`).
        outputs: with data, every rank's flat ``OUT`` (None where it has none).
    """

    collective: str
    algorithm: str
    size: int
    count: int
    nbytes: int
    itemsize: int
    time: float
    finish: np.ndarray
    link_bytes: np.ndarray
    network: Network = field(repr=False)
    steps: int = 0
    messages: int = 0
    events: int = 0
    build_seconds: float = 0.0
    sim_seconds: float = 0.0
    records: list[StepRecord] | None = field(default=None, repr=False)
    outputs: list[np.ndarray | None] | None = field(default=None, repr=False)

    def busiest_links(self, k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` links that carried the most bytes: ``(name, bytes)``, most first."""
        order = np.argsort(-self.link_bytes, kind="stable")[:k]
        return [(self.network.link_name(int(i)), float(self.link_bytes[i])) for i in order]

    def bytes_by_class(self) -> dict[str, float]:
        """Bytes carried per link class (e.g. ``intra``, ``inter``, ``port``)."""
        out: dict[str, float] = {}
        for klass, b in zip(self.network.link_class, self.link_bytes, strict=True):
            out[klass] = out.get(klass, 0.0) + float(b)
        return out


def context_count(collective: str, nbytes: int, itemsize: int, size: int) -> int:
    """``Context.count`` for a whole buffer of ``nbytes`` (rounded down to whole blocks).

    ``nbytes`` follows ``plait bench`` and nccl-tests: the vector for allreduce,
    reduce and broadcast; the whole input of reduce_scatter and alltoall; the
    whole output of allgather and gather; root's whole input of scatter.
    """
    return _collective(collective).unit_count(nbytes // itemsize, size)


def build_all(
    collective: str,
    algorithm: str,
    size: int,
    count: int,
    *,
    itemsize: int = 4,
    root: int = 0,
    segment: int = 0,
    commutative: bool = True,
    network: Network | None = None,
    counts: Sequence[int] | None = None,
    window: int = 0,
) -> list[Schedule]:
    """Every rank's schedule, exactly as the executor would get it.

    For an algorithm that needs a fabric (``in_network``), the network's
    aggregating switches' schedules follow the ranks'. ``counts``: an uneven
    collective's per-rank counts (``Context.counts``; ``count`` is then not read).
    ``window``: the bytes of shared window each rank may use (``Context.window``).

    Raises:
        ValueError: an unknown algorithm, ``root`` not a rank, a negative ``count``, ...
    """
    spec = get(collective, algorithm)
    root = _check_call(size, root, count if counts is None else 0, "count", itemsize)
    hosts_layout = network.host_layout() if network is not None else None
    fabric = None
    if spec.needs_fabric:
        if network is None:
            raise ValueError(f"{algorithm} needs a network with switches that reduce")
        fabric = network.aggregation_fabric()[0]
    _collective(collective).check_counts(size, counts)
    given = tuple(int(c) for c in counts) if counts is not None else None
    _check_uneven(collective, size, given, itemsize)
    ctx = Context(
        collective,
        0,
        size,
        count,
        itemsize,
        commutative,
        root,
        segment,
        hosts_layout,
        fabric,
        given,
        window,
    )
    return [build_schedule(spec, ctx.with_rank(r)) for r in range(ctx.participants)]


#: The largest buffer a call may have, in bytes: 2**63 - 1, the largest int64 (numpy's
#: largest array, ``sys.maxsize`` on a 64-bit machine). The compiled program holds element
#: counts and byte offsets as int64: beyond it they wrapped around (a wrong time, or 0) or
#: raised OverflowError. ``plait bench`` and ``plait sim`` refuse larger sizes alike.
MAX_BYTES = (1 << 63) - 1


def _integer(value: Any, name: str) -> int:
    """``value`` as a Python int, or TypeError naming ``name``: an int or a numpy integer, not
    a bool. A float root reached the builders (a TypeError of ``&`` deep in a tree's
    arithmetic), and an unsigned numpy one would wrap their ``(rank - root) % size``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int; got {value!r}")
    return int(value)


def _check_call(size: int, root: Any, amount: Any, name: str = "nbytes", itemsize: int = 1) -> int:
    """``root`` as an int, once checked to be one of the ``size`` ranks and ``amount`` (the
    argument ``name``, in units of ``itemsize`` bytes) not negative, with its bytes within
    :data:`MAX_BYTES`; TypeError where either is not an integer, ValueError where out of
    range. Unchecked, a root outside the ranks built schedules where no rank is the root (a
    reduce to -1 returned nothing, and passed its check) or that name a rank that does not
    exist; a negative size, regions of negative length; a size beyond int64, byte counts
    that wrapped around."""
    at = _integer(root, "root")
    amount = _integer(amount, name)
    if not 0 <= at < size:
        raise ValueError(f"root must be a rank, in 0..{size - 1}; got {root}")
    if amount < 0:
        raise ValueError(f"{name} must be >= 0; got {amount}")
    if amount * itemsize > MAX_BYTES:
        most = MAX_BYTES // itemsize
        unit = "" if itemsize == 1 else f" ({itemsize}-byte elements)"
        raise ValueError(
            f"{name} must be at most {most}{unit}, so that its bytes fit in int64 "
            f"(2**63 - 1); got {amount}"
        )
    return at


def _check_uneven(
    collective: str, size: int, counts: tuple[int, ...] | None, itemsize: int
) -> None:
    """ValueError unless the whole buffer ``counts`` make fits in :data:`MAX_BYTES` (as
    :func:`_check_call` does for an even call's size)."""
    if counts is None:
        return
    whole = _collective(collective).uneven_whole(size, counts) * itemsize
    if whole > MAX_BYTES:
        raise ValueError(
            f"{collective}: counts make a buffer of {whole} B; expected at most 2**63 - 1 B, "
            "so that its offsets fit in int64"
        )


#: The window :func:`simulate` gives one-sided algorithms by default: 2 MiB per rank, the
#: shared-memory transport's default (``PLAIT_SHM_WINDOW``).
WINDOW_BYTES = 2 << 20


def simulate(
    collective: str,
    algorithm: str,
    nbytes: int,
    network: Network,
    *,
    dtype: Any = np.float32,
    root: int = 0,
    segment_bytes: int | None = 0,
    op: Op | None = None,
    with_data: bool = False,
    inputs: Sequence[np.ndarray | None] | None = None,
    sharing: str = "maxmin",
    trace: bool = False,
    seed: int = 0,
    workers: int | None = None,
    counts: Sequence[int] | None = None,
    window: int | None = None,
) -> Result:
    """Simulate one call of ``collective`` with ``algorithm`` on every rank of ``network``.

    Args:
        collective, algorithm: as in ``plait.algorithms(collective)``.
        nbytes: the collective's whole buffer (see :func:`context_count`).
        network: a topology from this package; its size is the number of ranks.
        dtype: element type (sets the element size; with data, the arrays' type).
        root: for rooted collectives.
        segment_bytes: pipelining unit, as ``Context.segment`` in bytes; 0: unsegmented;
            None: what the communicator uses (``plait.selection.select.SEGMENT_BYTES``,
            defined with the algorithms as ``plait.algos._registry.SEGMENT_BYTES``).
        op: the reduction (default SUM); its commutativity picks the schedule.
        with_data: move real data and check every rank's result against the reference.
        inputs: with data, per rank ``x`` as the communicator call would take it (flat);
            default: reproducible random values from ``seed``.
        sharing: ``"maxmin"`` or ``"equal"`` bandwidth sharing (:mod:`plait.sim.engine`).
        trace: keep per-step timings for :func:`write_trace`.
        seed: seeds the random inputs of ``with_data``.
        workers: processes that build the schedules (None: all cores for big
            jobs, see :func:`plait.sim.program.build_program`; 1: this one).
        counts: for an uneven collective (``allgatherv``, ...), its per-rank
            element counts (``Context.counts``: one per rank, or alltoallv's
            size×size matrix row-major); ``nbytes`` is then not read and the
            result's ``nbytes`` is the whole buffer the counts make
            (:meth:`plait.collectives.Collective.uneven_whole`). None: the
            even call that ``nbytes`` sizes.
        window: the bytes of shared window each rank may use (``Context.window``;
            0: no shared arena, as between hosts), for the one-sided algorithms;
            None: :data:`WINDOW_BYTES` for those (the shared-memory transport's
            default), 0 for the others.

    Raises:
        TypeError: ``op`` is not a :class:`plait.Op` (as a communicator refuses it).
        ValueError: bad arguments (unknown algorithm, op not allowed by it or not defined
            for ``dtype``, ``root`` not a rank, ``nbytes`` negative or above
            :data:`MAX_BYTES`, negative ``segment_bytes``, ...).
        SimCheckError: with data, a result that differs from the reference.
    """
    op = op if op is not None else SUM
    if not isinstance(op, Op):  # first: a name ('sum') or a ufunc would fail deep in the build
        # The communicator's words for this mistake (plait._checks.check_op), less its rank.
        raise TypeError(
            f"{collective}: op must be a plait.Op such as plait.SUM or "
            f"plait.Op(np.logaddexp); got {op!r}"
        )
    dt = np.dtype(dtype)
    spec = get(collective, algorithm)
    if not spec.supports(commutative=op.commutative, fabric=True):
        raise ValueError(f"{collective}/{algorithm} needs a commutative op; {op!r} is not")
    table = _collective(collective)
    if table.reduces:
        try:
            op.check(dt)
        except TypeError as exc:  # e.g. BAND on floats: numpy would fail inside the run
            raise ValueError(f"{collective}: {exc}") from None
    if window is None:
        window = WINDOW_BYTES if spec.needs_window else 0
    elif _integer(window, "window") < 0:
        raise ValueError(f"window must be >= 0 bytes (0: no shared arena); got {window}")
    window = int(window)
    p = network.size
    root = _check_call(p, root, nbytes if counts is None else 0)
    fabric, run_on = None, network
    if spec.needs_fabric:  # the aggregating switches become participants after the ranks
        fabric, nodes = network.aggregation_fabric()
        run_on = network.with_agents(nodes)
    table.check_counts(p, counts)
    given = tuple(int(c) for c in counts) if counts is not None else None
    _check_uneven(collective, p, given, dt.itemsize)
    if segment_bytes is not None and _integer(segment_bytes, "segment_bytes") < 0:
        raise ValueError(
            f"segment_bytes must be >= 0 (0: unsegmented) or None (the communicator's); "
            f"got {segment_bytes}"
        )
    count = 0 if given is not None else context_count(collective, nbytes, dt.itemsize, p)
    if segment_bytes is None:
        segment_bytes = SEGMENT_BYTES
    segment = max(1, segment_bytes // dt.itemsize) if segment_bytes else 0
    t0 = time.perf_counter()
    program = build_program(
        collective,
        algorithm,
        p,
        count,
        itemsize=dt.itemsize,
        root=root,
        segment=segment,
        commutative=op.commutative,
        hosts=network.host_layout(),
        fabric=fabric,
        workers=workers,
        keep_schedules=with_data,
        counts=given,
        window=window,
    )
    built = time.perf_counter() - t0
    data = None
    xs: list[np.ndarray | None] = []
    if with_data:
        assert program.schedules is not None
        xs = input_arrays(collective, p, count, dt, inputs, seed, counts=given, root=root)
        data = start_buffers(collective, program.schedules, xs, dt, root, op)
    out = run(program, run_on, sharing=sharing, data=data, record=trace)
    whole = table.uneven_whole(p, given) if given is not None else table.whole_count(count, p)
    result = _result(
        collective, algorithm, p, count, whole * dt.itemsize, dt.itemsize, network, out
    )
    result.build_seconds = built
    if with_data:
        assert program.schedules is not None
        result.outputs = check(collective, out, xs, op, root, p, counts=given)
    return result


def simulate_schedules(
    schedules: Sequence[Schedule],
    network: Network,
    itemsize: int,
    *,
    sharing: str = "maxmin",
    trace: bool = False,
) -> Result:
    """Time arbitrary schedules (one per rank), e.g. several collectives' built by hand."""
    out = run_schedules(schedules, network, itemsize, sharing=sharing, record=trace)
    return _result("custom", "custom", len(schedules), 0, 0, itemsize, network, out)


def _result(
    collective: str,
    algorithm: str,
    p: int,
    count: int,
    nbytes: int,
    itemsize: int,
    network: Network,
    out: Outcome,
) -> Result:
    return Result(
        collective=collective,
        algorithm=algorithm,
        size=p,
        count=count,
        nbytes=nbytes,
        itemsize=itemsize,
        time=max(out.finish[:p], default=0.0),
        finish=np.asarray(out.finish[:p], dtype=np.float64),
        link_bytes=np.asarray(out.link_bytes, dtype=np.float64),
        network=network,
        steps=out.steps,
        messages=out.messages,
        events=out.events,
        sim_seconds=out.seconds,
        records=out.records,
    )
