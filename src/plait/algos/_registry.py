"""The registry of algorithms: one :class:`AlgorithmSpec` per (collective, name).

Algorithm modules register themselves with :func:`register`; restrictions are
data on the spec (``commutative_only``, ``in_place``, ``needs_fabric``) that the
selector and the API read, so no caller repeats them as ``if`` statements.
:func:`algorithms` lists the names as :class:`AlgorithmName` strings, which
carry the one restriction a listing must show: an algorithm that runs only in
the simulator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from plait.algos._cost import Cost
from plait.algos._presence import meets_when_empty
from plait.collectives import COLLECTIVES, REDUCING, TABLE, UNEVEN_COLLECTIVES
from plait.collectives import get as _collective
from plait.schedule.builder import Builder, Context, record
from plait.schedule.ir import Schedule

__all__ = [
    "COLLECTIVES",
    "REDUCING",
    "SEGMENT_BYTES",
    "SIMULATOR_ONLY",
    "UNEVEN_COLLECTIVES",
    "AlgorithmName",
    "AlgorithmSpec",
    "algorithms",
    "buffer_counts",
    "build_schedule",
    "get",
    "register",
    "specs",
]

BuildFn = Callable[[Builder], None]

#: Pipelining unit, in bytes, of the segmented algorithms (ring, trees) where nothing
#: says otherwise: what a communicator's ``auto`` uses (re-exported by
#: :mod:`plait.selection.select`) and what ``plait.sim.simulate(segment_bytes=None)`` means.
SEGMENT_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class AlgorithmSpec:
    """One algorithm of one collective.

    Attributes:
        collective: the collective it implements.
        name: the string users pass as ``algorithm=``.
        build: records one rank's steps on a :class:`Builder` (``b.ctx`` says which).
        commutative_only: whether it needs a commutative op (it reduces out of rank order).
        in_place: whether it is correct when ``OUT`` is the same memory as ``IN``;
            if not, in-place calls stage the input in scratch first.
        summary: first line of the builder's docstring.
        needs_fabric: whether it runs only where switches reduce in flight
            (``Context.fabric``, which the simulator provides and plait's
            transports do not); ``auto`` never picks such an algorithm for a
            communicator.
        needs_window: whether it is one-sided (:mod:`plait.algos.arena`): it runs only
            where the ranks share a window (``Context.window``: one host, shared
            memory); ``auto`` picks it only there, and never through the profile.
        host_windows: whether a window per host is enough (with ``needs_window``: its
            schedule reads only the windows of its own host's ranks and exchanges
            messages across hosts; Note [mixed schedules] in :mod:`plait.schedule.ir`).
        cost: its closed-form time on the flat network (:class:`plait.algos._cost.Cost`),
            written next to its builder; None where there is none. ``auto``'s
            profile ranks candidates with it, and the tests hold it to the simulator.
    """

    collective: str
    name: str
    build: BuildFn
    commutative_only: bool = False
    in_place: bool = True
    summary: str = ""
    needs_fabric: bool = False
    cost: Cost | None = None
    needs_window: bool = False
    host_windows: bool = False

    def supports(self, *, commutative: bool, fabric: bool = False) -> bool:
        """Whether the restrictions allow an op of this commutativity (``fabric``: on a
        network with aggregating switches)."""
        return (commutative or not self.commutative_only) and (fabric or not self.needs_fabric)


#: How listings mark an algorithm with ``needs_fabric`` (``plait algorithms``, reprs).
SIMULATOR_ONLY = "simulator only: needs aggregating switches"


class AlgorithmName(str):
    """An algorithm's name as :func:`algorithms` lists it: the plain string, marked.

    It compares, hashes, formats and is accepted as ``algorithm=`` exactly as
    the plain name (the listing stays a tuple of strings). ``simulator_only``
    says whether only :mod:`plait.sim` can run it (``in_network``: switches
    that reduce in flight, which plait's transports do not have); such a name's
    ``repr`` says so, so that a listing printed at the prompt shows it.
    """

    simulator_only: bool

    def __new__(cls, name: str, *, simulator_only: bool = False) -> AlgorithmName:
        self = super().__new__(cls, name)
        self.simulator_only = simulator_only
        return self

    def __repr__(self) -> str:
        plain = str.__repr__(self)
        return f"{plain} ({SIMULATOR_ONLY})" if self.simulator_only else plain


#: Every collective of the table, the uneven ones (:data:`UNEVEN_COLLECTIVES`) too.
_REGISTRY: dict[str, dict[str, AlgorithmSpec]] = {c: {} for c in TABLE}
#: The listed names per collective, made once at registration.
_NAMES: dict[str, dict[str, AlgorithmName]] = {c: {} for c in TABLE}


def register(
    collective: str,
    name: str,
    *,
    commutative_only: bool = False,
    in_place: bool = True,
    needs_fabric: bool = False,
    cost: Cost | None = None,
    needs_window: bool = False,
    host_windows: bool = False,
) -> Callable[[BuildFn], BuildFn]:
    """Class the decorated builder as ``collective``'s algorithm ``name``.

    ``cost``: its closed-form time, when it has one (see :mod:`plait.algos._cost`).
    ``host_windows``: it needs a window on every host (implies ``needs_window``).
    """
    if collective not in _REGISTRY:
        raise ValueError(f"unknown collective {collective!r}; expected one of {tuple(TABLE)}")

    def decorate(build: BuildFn) -> BuildFn:
        table = _REGISTRY[collective]
        if name in table:
            known = table[name].build
            if known is not build and getattr(known, "__wrapped__", None) is not build:
                raise ValueError(f"algorithm {name!r} is already registered for {collective}")
        summary = (build.__doc__ or "").strip().splitlines()[0] if build.__doc__ else ""
        table[name] = AlgorithmSpec(
            collective,
            name,
            # A call with nothing to move still meets its peers (Note [empty calls meet]);
            # a barrier always does, and a fabric's switches are the simulator's.
            build
            if collective == "barrier" or needs_fabric
            else meets_when_empty(build, needs_window or host_windows),
            commutative_only,
            in_place,
            summary,
            needs_fabric,
            cost,
            needs_window or host_windows,
            host_windows,
        )
        _NAMES[collective][name] = AlgorithmName(name, simulator_only=needs_fabric)
        return build

    return decorate


def _check_collective(collective: str) -> dict[str, AlgorithmSpec]:
    try:
        return _REGISTRY[collective]
    except KeyError:
        raise ValueError(
            f"unknown collective {collective!r}; expected one of {', '.join(TABLE)}"
        ) from None


def algorithms(collective: str) -> tuple[AlgorithmName, ...]:
    """Names of the algorithms of ``collective``, in registration order.

    Each is an :class:`AlgorithmName`, a str whose ``simulator_only`` marks the
    ones a communicator refuses (they need aggregating switches; see plait.sim).
    """
    _check_collective(collective)
    return tuple(_NAMES[collective].values())


def specs(collective: str) -> tuple[AlgorithmSpec, ...]:
    """The specs of ``collective``'s algorithms."""
    return tuple(_check_collective(collective).values())


def get(collective: str, name: str) -> AlgorithmSpec:
    """The spec of ``collective``'s algorithm ``name``; ValueError naming the choices if unknown."""
    table = _check_collective(collective)
    try:
        return table[name]
    except KeyError:
        if name == "auto":  # the caller's own choice among them: here, one must be named
            raise ValueError(
                f"'auto' is plait's choice among the algorithms of {collective}, not one of "
                "them; name one here: " + ", ".join(table)
            ) from None
        raise ValueError(
            f"unknown algorithm {name!r} for {collective}; expected 'auto' or one of: "
            + ", ".join(table)
        ) from None


def buffer_counts(
    collective: str,
    size: int,
    count: int,
    rank: int,
    root: int,
    counts: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """Element counts of (IN, OUT) for one rank; see :class:`Context` for ``count`` and ``counts``.

    A fabric's switches (``rank >= size``) have neither: they work in scratch.
    """
    return _collective(collective).buffer_counts(size, count, rank, root, counts)


@functools.lru_cache(maxsize=4096)
def build_schedule(spec: AlgorithmSpec, ctx: Context) -> Schedule:
    """Record ``spec``'s schedule for ``ctx`` (cached: schedules are immutable)."""
    if ctx.collective != spec.collective:
        raise ValueError(f"{spec.name} builds {spec.collective}, not {ctx.collective}")
    return record(spec.build, ctx)
