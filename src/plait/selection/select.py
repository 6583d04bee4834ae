"""``algorithm="auto"``: pick an algorithm and a segment size from values every rank knows.

In order (:func:`choose`):

1. the user's PLAIT_ALGO entries (:mod:`plait.selection.overrides`);
2. the user's rules file (:mod:`plait.selection.rules_file`: PLAIT_RULES or
   ``~/.config/plait/rules.toml``);
3. with a measured profile (``plait tune``), the (algorithm, segment) pair
   with the lowest predicted time (:mod:`plait.selection.model`: closed forms
   and the simulator, on one host, and across hosts where every host has the
   same number of ranks), except on one host that runs more ranks than it has
   cores: there the ranks wait for each other to be scheduled, which the
   α-β-γ model has no term for, and the rules (4) decide;
4. a rules table per collective, after MPICH's and Open MPI's defaults
   (Thakur et al. 2005): latency-optimal algorithms for small messages,
   bandwidth-optimal ones for large, and the world size where it matters.

Entries of 1 and 2 that name no segment, and the rules of 4, use
:data:`SEGMENT_BYTES`. The inputs (collective, world size, message bytes, op
commutativity, host layout, and the :class:`Settings`: PLAIT_ALGO, the rules
file and the profile, which a communicator reads once when it is created)
are identical on all ranks, so every rank chooses the same schedule.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

from plait.algos._registry import SEGMENT_BYTES, AlgorithmSpec, algorithms, get
from plait.schedule.builder import HostLayout
from plait.selection import model, rules_file
from plait.selection.overrides import Override, overrides

__all__ = [
    "RULES",
    "SEGMENT_BYTES",
    "Choice",
    "Rule",
    "Settings",
    "choose",
    "fingerprint",
    "select",
    "settings",
]

_INF = float("inf")


@dataclass(frozen=True)
class Rule:
    """Use the first of ``algorithms`` the call allows when ranks and bytes are in range.

    ``nbytes`` is the whole vector for allreduce/reduce/broadcast and one
    rank's block for the block collectives (reduce_scatter, allgather,
    alltoall, gather, scatter). Ranges are half-open: ``min <= x < max``.
    """

    algorithms: tuple[str, ...]
    max_bytes: float = _INF
    min_ranks: int = 1
    max_ranks: float = _INF
    multi_host: bool | None = None  # True/False: only when ranks do/don't span hosts
    pof2: bool | None = None  # True: only when the number of ranks is a power of two
    # True/False: only when one host runs more/no more ranks than it has cores
    oversubscribed: bool | None = None
    # True: only when the ranks share a window (one host, shared memory: the one-sided
    # algorithms); False: only when they do not
    shared: bool | None = None
    segment: int = 0  # bytes per piece (Choice.segment_bytes); 0: SEGMENT_BYTES

    def applies(
        self,
        size: int,
        nbytes: int,
        multi_host: bool,
        oversubscribed: bool = False,
        shared: bool = False,
    ) -> bool:
        """Whether the call is in this rule's range."""
        return (
            (self.shared is None or self.shared == shared)
            and nbytes < self.max_bytes
            and self.min_ranks <= size < self.max_ranks
            and (self.multi_host is None or self.multi_host == multi_host)
            and (self.pof2 is None or self.pof2 == (size & (size - 1) == 0))
            and (self.oversubscribed is None or self.oversubscribed == oversubscribed)
        )


#: Bytes per piece of the one-sided algorithms (plait.algos.arena): a piece is copied in,
#: reduced and copied out while it stays in cache (docs/performance.md).
ARENA_PIECE_BYTES = 1 << 20
#: A window of at least this many bytes per half holds full pieces. In a smaller one (a
#: ``PLAIT_SHM_WINDOW`` set lower) the pieces are smaller and a call larger than the
#: window ran slower one-sided than through messages (2 ranks, 256 KiB window: 1 MiB 650
#: against 210 µs, 4 MiB 1.8 against 1.0 ms), so ``auto`` goes one-sided there only for
#: calls that fit in the window (Communicator._choose). A split's group has the full size
#: and reserves its memory as calls need it (Note [split windows]).
FULL_WINDOW_BYTES = 2 * ARENA_PIECE_BYTES

RULES: dict[str, tuple[Rule, ...]] = {
    "allreduce": (
        # Ranks sharing a window (one host): the one-sided algorithms of plait.algos.arena.
        # More ranks than cores: the time is all ranks' work, and one rank reducing for all
        # does the least (plait bench --rounds 3, 2 cores: 3 ranks 0.62-0.75 x the one-shot's
        # time from 8 B to 32 KiB; 4 ranks 0.93-0.99 x up to 4 KiB, 0.69 x at 32 KiB; level
        # with the two-shot from 64 KiB; docs/performance.md, "One rank reduces for all").
        Rule(("arena_leader",), max_bytes=32 << 10, shared=True, oversubscribed=True),
        # Small vectors: one wait and p-1 reductions beat two waits and one (2 ranks:
        # up to 64 KiB, 13-20 % faster; measured with plait bench -a arena,arena_oneshot).
        Rule(("arena_oneshot",), max_bytes=128 << 10, max_ranks=3, shared=True),
        Rule(("arena_oneshot",), max_bytes=16 << 10, shared=True),
        Rule(("arena",), shared=True, segment=ARENA_PIECE_BYTES),
        # Measured with examples/auto_vs_best.py (plait bench --rounds, 2 and 4 ranks, shared
        # memory and TCP, 8 B .. 256 MiB, compared round by round; docs/performance.md).
        # More ranks than cores on one host: every round of recursive doubling needs every
        # rank scheduled, while a binomial reduce and broadcast keep half the ranks idle at
        # each level, so fewer wait for a core (4 ranks on 2 cores: binomial the fastest or
        # within noise of it from 8 B to 512 KiB, recursive doubling 1.05-2x slower).
        Rule(("binomial",), max_bytes=1 << 20, multi_host=False, oversubscribed=True),
        # recursive doubling's lg p rounds win up to 512 KiB, where ring's 2(p-1) rounds of
        # per-message cost still dominate.
        # (With at most 8 ranks: recursive doubling sends lg p whole vectors, ring 2 in all.)
        Rule(("recursive_doubling",), max_bytes=512 << 10, max_ranks=9, multi_host=False),
        # Large vectors on a few ranks of one host: direct's two steps reduce straight from
        # the input (no copy of it first), the fastest or within 10 % of it from 1 to
        # 256 MiB; Rabenseifner and ring 1.1-1.4x slower.
        Rule(("direct",), max_ranks=9, multi_host=False),
        Rule(("recursive_doubling",), max_bytes=16 << 10),
        # Across hosts (inter-host links slower than intra-host ones): keep one
        # slice per rank on the network; pipeline the stages for large vectors.
        Rule(("hierarchical", "recursive_doubling"), max_bytes=4 << 20, multi_host=True),
        Rule(("cascade", "direct"), multi_host=True),
        Rule(("rabenseifner", "recursive_doubling"), max_bytes=1 << 20, min_ranks=16),
        # Large vectors on a power of two: Rabenseifner moves as few bytes as ring in lg p
        # rounds instead of 2(p - 1).
        Rule(("rabenseifner", "ring", "direct"), pof2=True, multi_host=False),
        Rule(("ring", "direct")),
    ),
    "reduce": (
        Rule(("arena",), shared=True, segment=ARENA_PIECE_BYTES),
        Rule(("binomial",), max_bytes=64 << 10),
        Rule(("rabenseifner", "binomial")),
    ),
    "broadcast": (
        Rule(("arena",), shared=True, segment=ARENA_PIECE_BYTES),
        Rule(("binomial",), max_ranks=8),
        Rule(("binomial",), max_bytes=12 << 10),
        Rule(("scatter_allgather",)),
    ),
    "reduce_scatter": (
        Rule(("arena",), shared=True, segment=ARENA_PIECE_BYTES),
        Rule(("recursive_halving", "pairwise"), max_bytes=64 << 10),
        Rule(("ring", "pairwise")),
    ),
    "allgather": (
        Rule(("arena",), shared=True, segment=ARENA_PIECE_BYTES),
        Rule(("bruck",), max_bytes=8 << 10),
        Rule(("ring",)),
    ),
    "alltoall": (
        Rule(("arena",), shared=True, segment=ARENA_PIECE_BYTES),
        Rule(("bruck",), max_bytes=256, min_ranks=8),
        Rule(("pairwise",)),
    ),
    "gather": (Rule(("arena",), shared=True, segment=ARENA_PIECE_BYTES), Rule(("binomial",))),
    "scatter": (Rule(("arena",), shared=True, segment=ARENA_PIECE_BYTES), Rule(("binomial",))),
    "barrier": (Rule(("arena",), shared=True), Rule(("dissemination",))),
}


@dataclass(frozen=True)
class Choice:
    """What a call runs: ``spec`` with messages cut into ``segment_bytes`` pieces.

    ``source`` says who decided: ``"PLAIT_ALGO"``, ``"rules file"``,
    ``"profile"`` (the model; ``"profile, simulated"`` when the simulator
    timed the winner), ``"built-in rules"``, or ``"caller"`` (an explicit
    ``algorithm=``).
    """

    spec: AlgorithmSpec
    segment_bytes: int = SEGMENT_BYTES
    source: str = "built-in rules"

    @property
    def name(self) -> str:
        """The algorithm's name."""
        return self.spec.name

    def segment(self, itemsize: int) -> int:
        """``Context.segment``: elements per message for elements of ``itemsize`` bytes."""
        return max(1, self.segment_bytes // itemsize)


@dataclass(frozen=True)
class Settings:
    """What the user configured for ``auto``: PLAIT_ALGO, the rules file, the profile."""

    overrides: tuple[Override, ...] = ()
    rules: rules_file.RulesFile | None = None
    profile: model.Profile | None = None


def settings() -> Settings:
    """The settings of the current environment and files.

    Raises:
        ValueError: a malformed PLAIT_ALGO, or a rules file that is missing
            (where PLAIT_RULES names it), unreadable or invalid
            (:class:`~plait.selection.rules_file.RulesError`).
    """
    return Settings(overrides(), rules_file.load(), model.load())


def fingerprint(config: Settings) -> str:
    """``config`` in one line: a digest of what ``auto`` follows (PLAIT_ALGO's overrides, the
    rules file's entries, the profile's numbers; never paths, which may differ from host to
    host for the same files), then where it comes from, for errors.

    ``plait.init`` compares it across ranks (Note [one configuration] in plait._meeting):
    ranks that follow different settings choose different algorithms for some call, and
    meet there with a MismatchError that breaks the communicator.
    """
    import hashlib
    import json

    # What decides, in a canonical order: a profile's numbers without its "measured" notes
    # (which no choice reads), and each collective's entries in their own order (matching
    # never compares entries of different collectives).
    profile = None if config.profile is None else config.profile.to_json()
    if profile is not None:
        profile.pop("measured", None)
    rules = config.rules.entries if config.rules is not None else ()  # empty: as none
    overrides = sorted(config.overrides, key=lambda o: o.collective)  # stable
    ordered = [replace(e, where="") for e in sorted(rules, key=lambda e: e.collective)]
    what = repr((overrides, ordered, json.dumps(profile, sort_keys=True)))
    words = []
    if config.overrides:
        words.append(f"PLAIT_ALGO={os.environ.get('PLAIT_ALGO', '').strip()!r}")
    if rules and config.rules is not None:
        words.append(f"the rules file {config.rules.path}")
    if config.profile is not None:
        words.append(f"the profile {model.default_path()}")
    said = ", ".join(words) or "plait's built-in rules alone"
    return f"{hashlib.sha256(what.encode()).hexdigest()[:16]} {said}".replace("\n", " ")


def _can_run(spec: AlgorithmSpec, shared: bool, host_windows: bool, multi_host: bool) -> bool:
    """Whether the windows there are let ``spec`` run: a one-sided algorithm needs one
    window for all ranks; one with ``host_windows`` needs that on one host, and a window per
    host (not one shared across them: Note [mixed schedules]) across hosts."""
    if spec.host_windows:
        return (shared and not multi_host) or (host_windows and not shared)
    return shared or not spec.needs_window


def choose(
    collective: str,
    size: int,
    nbytes: int,
    *,
    commutative: bool,
    hosts: HostLayout | None = None,
    config: Settings | None = None,
    shared: bool = False,
    host_windows: bool = False,
) -> Choice:
    """The algorithm and segment size ``auto`` runs for this call.

    ``nbytes``: the whole vector for allreduce/reduce/broadcast, one rank's
    block for the block collectives; ``hosts``: None when all ranks share one
    host; ``config``: the settings to follow (default: :func:`settings` now);
    ``shared``: the ranks share a window (the one-sided algorithms can run);
    ``host_windows``: across hosts, the ranks of each host share a window of
    their own (the algorithms registered with ``host_windows`` can run).
    See the module docstring for the order.
    """
    config = settings() if config is None else config
    multi_host = hosts is not None and hosts.n_hosts > 1
    for entry in config.overrides:
        if entry.collective == collective and entry.covers(nbytes):
            spec = get(collective, entry.algorithm)
            if spec.supports(commutative=commutative) and _can_run(
                spec, shared, host_windows, multi_host
            ):
                return Choice(spec, entry.segment or SEGMENT_BYTES, "PLAIT_ALGO")
    if config.rules is not None:
        hit = config.rules.match(
            collective, size, nbytes, commutative=commutative, multi_host=multi_host
        )
        if hit is not None and _can_run(
            get(collective, hit.algorithm), shared, host_windows, multi_host
        ):
            return Choice(
                get(collective, hit.algorithm), hit.segment or SEGMENT_BYTES, "rules file"
            )
    crowded = not multi_host and size > _cores()  # ranks share cores
    rule_spec, rule = _by_rules(collective, size, nbytes, commutative, multi_host, crowded, shared)
    profile = config.profile
    if rule.shared:  # the profile's model times messages only
        return Choice(rule_spec, rule.segment or SEGMENT_BYTES, "built-in rules")
    if profile is not None and size > 1 and not crowded:  # the model has no term for sharing
        names = tuple(
            n
            for n in algorithms(collective)
            if get(collective, n).supports(commutative=commutative)
            and not get(collective, n).needs_window
        )
        best = model.predict(
            collective,
            size,
            nbytes,
            names,
            profile,
            commutative=commutative,
            hosts=hosts if multi_host else None,
            baseline=rule_spec.name,
            default_segment=SEGMENT_BYTES,
        )
        if best is not None:
            source = "profile, simulated" if best.method == "simulator" else "profile"
            return Choice(get(collective, best.algorithm), best.segment, source)
    return Choice(rule_spec, SEGMENT_BYTES, "built-in rules")


def select(
    collective: str,
    size: int,
    nbytes: int,
    *,
    commutative: bool,
    hosts: HostLayout | None = None,
    shared: bool = False,
) -> AlgorithmSpec:
    """The algorithm ``auto`` runs for this call (:func:`choose`'s, without the segment)."""
    return choose(
        collective, size, nbytes, commutative=commutative, hosts=hosts, shared=shared
    ).spec


@functools.cache
def _cores() -> int:
    """Cores of this host (os.cpu_count: the same for every process on it, whatever its
    affinity, so every rank of a one-host job sees the same number)."""
    return os.cpu_count() or 1


def _by_rules(
    collective: str,
    size: int,
    nbytes: int,
    commutative: bool,
    multi_host: bool,
    crowded: bool,
    shared: bool = False,
) -> tuple[AlgorithmSpec, Rule]:
    """The built-in rules' algorithm (:data:`RULES`) and the rule that chose it;
    ``crowded``: one host, more ranks than cores; ``shared``: the ranks share a window."""
    rules = RULES[collective]
    for rule in rules:
        if rule.applies(size, nbytes, multi_host, crowded, shared):
            for name in rule.algorithms:
                spec = get(collective, name)
                if spec.supports(commutative=commutative):
                    return spec, rule
    for rule in rules:  # nothing in range fits the op: any algorithm that does
        if rule.shared and not shared:
            continue
        for name in rule.algorithms:
            spec = get(collective, name)
            if spec.supports(commutative=commutative):
                return spec, rule
    raise LookupError(f"no {collective} algorithm supports this call")  # pragma: no cover
