"""The measured cost model behind ``algorithm="auto"``: α, β, γ per link class.

A :class:`Profile` holds, for each class of link (``intra``: ranks on one
host; ``inter``: across hosts), the per-message latency α (seconds) and the
per-byte time β (seconds per byte), plus the per-byte cost of reducing (γ)
and of copying (δ) on a rank. ``plait tune`` measures them on the machine it
runs on and writes them to a profile file (:func:`default_path`, or
PLAIT_PROFILE); every later run loads it.

With a profile, ``auto`` predicts the time of each candidate (algorithm,
segment size) and runs the fastest (:func:`predict`):

* On one host, the closed-form α-β-γ costs of plait's own schedules (each
  algorithm's ``AlgorithmSpec.cost``, the formulas the simulator is tested against)
  rank the algorithms, unsegmented. For calls of more than the smallest of
  :data:`SEGMENTS`, the two best are then run in the simulator
  (:mod:`plait.sim`, on :func:`plait.sim.from_profile`'s network, with ports),
  with the built-in rules' choice where no formula covers it (``direct``,
  which the rules pick for large vectors on a few ranks; where it does not fit
  in the simulator's budget, the rules decide); the two fastest of
  those are run at each segment size of :data:`SEGMENTS`, and the fastest
  (algorithm, segment) pair wins; the formulas cannot see pipelining.
* Across hosts (a profile with an ``inter`` link, the same number of ranks on
  every host, ranks numbered host by host), and on one host for collectives
  with fewer than two formulas, every algorithm is simulated on the profile's
  network at the default segment, the built-in rules' choice first, then the
  two best at the other segment sizes. Other layouts keep the built-in rules.

The simulator is bounded so that a choice takes milliseconds: at most
:data:`SIM_MAX_RANKS` ranks and :data:`SIM_STEPS` simulated steps per choice,
all candidates together; a candidate whose estimated steps (from rank 0's
schedule) do not fit in what is left is skipped, and where the first one (the
formulas' winner, or across hosts the built-in rules' choice) does not fit,
the formulas or the rules decide alone. Results are cached per call shape.

The closed forms come from the algorithms' registrations
(``AlgorithmSpec.cost``); the simulator is :mod:`plait.sim`, which depends
only on the table of collectives, the schedule IR and the algorithms, so this
module reaches down to it. It is imported only when a profile asks for a
simulation, which keeps ``import plait`` from loading it.

Every input (collective, ranks, bytes, the op's commutativity, the host
layout and the profile) is the same on every rank, and the formulas, the
budget and the simulator are deterministic (ties go to the earlier
candidate), so every rank picks the same pair, provided every rank loads the
same profile (``plait.init`` refuses ranks whose PLAIT_ALGO, rules file or
profile differ: Note [one configuration] in plait._meeting). Calls the model does not cover
(uneven layouts, no ``inter`` link, one candidate and nothing to segment)
keep the built-in rules.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from plait.algos._registry import build_schedule, get
from plait.collectives import get as _collective
from plait.schedule.builder import Context, HostLayout

if TYPE_CHECKING:
    from plait.sim.network import Network

__all__ = [
    "SEGMENTS",
    "SIM_MAX_RANKS",
    "SIM_STEPS",
    "LinkCost",
    "Prediction",
    "Profile",
    "default_path",
    "formula_time",
    "load",
    "predict",
    "predict_best",
    "save",
]

#: Segment sizes (bytes) ``auto`` tries when it simulates; the default, 1 MiB, is one of them.
SEGMENTS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
#: The simulator predicts calls of at most this many ranks ...
SIM_MAX_RANKS = 64
#: ... and runs at most this many steps (all ranks, all candidates) per choice.
SIM_STEPS = 800
#: Finalists whose segment sizes are tried.
FINALISTS = 2

_log = logging.getLogger("plait")

#: Format of the profile file; a file of another version is ignored with a warning.
VERSION = 1


@dataclass(frozen=True)
class LinkCost:
    """α (seconds per message) and β (seconds per byte) of one class of link."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class Profile:
    """Measured costs: per link class, and per byte reduced (γ) and copied (δ)."""

    intra: LinkCost
    inter: LinkCost | None = None
    gamma: float = 0.0
    delta: float = 0.0
    measured: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (with the format version)."""
        return {"version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any) -> Profile:
        """The profile a :meth:`to_json` dict describes.

        Raises:
            ValueError: not a JSON object, another format version, or missing or negative
                fields.
        """
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise ValueError(f"malformed profile: a JSON object expected, not {kind}")
        if data.get("version") != VERSION:
            raise ValueError(f"profile format {data.get('version')!r}; this plait reads {VERSION}")
        try:
            intra = LinkCost(float(data["intra"]["alpha"]), float(data["intra"]["beta"]))
            inter = (
                LinkCost(float(data["inter"]["alpha"]), float(data["inter"]["beta"]))
                if data.get("inter")
                else None
            )
            prof = cls(
                intra,
                inter,
                float(data.get("gamma", 0.0)),
                float(data.get("delta", 0.0)),
                dict(data.get("measured", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed profile: {exc}") from None
        values = [intra.alpha, intra.beta, prof.gamma, prof.delta]
        if inter is not None:
            values += [inter.alpha, inter.beta]
        if any(not v >= 0 for v in values):
            raise ValueError("profile values must be non-negative numbers")
        return prof


def default_path() -> Path:
    """PLAIT_PROFILE, else ``$XDG_CONFIG_HOME/plait/profile.json`` (``~/.config/...``)."""
    explicit = os.environ.get("PLAIT_PROFILE", "").strip()
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".config"
    )
    return Path(base) / "plait" / "profile.json"


def save(profile: Profile, path: Path | None = None) -> Path:
    """Write ``profile`` (atomically: a reader never sees half a file); returns the path."""
    path = default_path() if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    os.replace(tmp, path)
    _load.cache_clear()
    return path


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime: float) -> Profile | None:
    try:
        return Profile.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as exc:
        import logging

        logging.getLogger("plait").warning("ignoring the profile %s: %s", path, exc)
        return None


def load() -> Profile | None:
    """The profile at :func:`default_path`, or None when there is none (or it is unreadable)."""
    path = default_path()
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    return _load(str(path), mtime)


def predict_best(
    collective: str,
    size: int,
    nbytes: int,
    candidates: list[str],
    profile: Profile,
) -> tuple[str, float] | None:
    """The candidate with the lowest predicted time on one host, and that time.

    ``nbytes`` as ``auto`` counts it (one rank's block for block collectives).
    None when the formulas cover fewer than two candidates.
    """
    whole = _collective(collective).whole_count(nbytes, size)
    ranked = _formula_ranking(collective, size, whole, tuple(candidates), profile)
    return (ranked[0][1], ranked[0][0]) if len(ranked) >= 2 else None


def formula_time(
    collective: str, algorithm: str, size: int, whole: int, profile: Profile, link: LinkCost
) -> float | None:
    """The closed-form time of ``algorithm`` with ``link``'s α, β and the profile's γ, δ.

    ``whole``: the collective's whole buffer (as the formulas count it); None
    where no formula covers the algorithm (or there is no such algorithm).
    """
    try:
        cost = get(collective, algorithm).cost
    except ValueError:
        return None
    if cost is None:
        return None
    return cost.time(size, whole, link.alpha, link.beta, profile.gamma, profile.delta)


@dataclass(frozen=True)
class Prediction:
    """The fastest candidate: ``algorithm`` cut into ``segment``-byte messages, ``time`` seconds.

    ``method``: ``"formulas"`` or ``"simulator"``, whichever timed the winner.
    """

    algorithm: str
    segment: int
    time: float
    method: str


def predict(
    collective: str,
    size: int,
    nbytes: int,
    candidates: tuple[str, ...],
    profile: Profile,
    *,
    commutative: bool = True,
    hosts: HostLayout | None = None,
    baseline: str | None = None,
    default_segment: int = 1 << 20,
) -> Prediction | None:
    """The (algorithm, segment) the profile predicts fastest; None where the model has no say.

    ``nbytes`` as ``auto`` counts it (one rank's block for block collectives);
    ``candidates``: the algorithms that allow the call's op, in a fixed order;
    ``hosts``: the host layout (None: one host); ``baseline``: the built-in
    rules' choice, simulated first across hosts (if it does not fit the
    budget, the rules decide). Cached per call shape; see the module docstring.
    """
    multi = hosts is not None and hosts.n_hosts > 1
    return _predict(
        collective,
        size,
        nbytes,
        tuple(candidates),
        profile,
        commutative,
        hosts if multi else None,
        baseline,
        default_segment,
    )


@functools.lru_cache(maxsize=256)
def _predict(
    collective: str,
    size: int,
    nbytes: int,
    candidates: tuple[str, ...],
    profile: Profile,
    commutative: bool,
    hosts: HostLayout | None,
    baseline: str | None,
    default_segment: int,
) -> Prediction | None:
    from plait import sim

    whole = _collective(collective).whole_count(nbytes, size)
    ranked = _formula_ranking(collective, size, whole, candidates, profile) if not hosts else []
    if len(ranked) >= 2:
        # One host, formulas for two or more: they rank; the simulator looks at segments.
        first = Prediction(ranked[0][1], default_segment, ranked[0][0], "formulas")
        if whole <= SEGMENTS[0] or size > SIM_MAX_RANKS:
            return first
        search = _Search(collective, size, whole, sim.from_profile(profile, size), commutative)
        finalists = [name for _, name in ranked[:FINALISTS]]
        # The rules' choice without a formula is simulated too; where it cannot be
        # (over the budget), nothing weighs against it, and the rules decide.
        unranked = baseline in candidates and all(name != baseline for _, name in ranked)
        if search.time(finalists[0], default_segment) is None:
            return None if unranked else first  # too big to simulate: the formulas alone
        if unranked:
            assert baseline is not None
            finalists.append(baseline)
        for name in finalists[1:]:
            search.time(name, default_segment)
        if unranked and search.times.get((cast(str, baseline), default_segment)) is None:
            return None
    else:
        # Across hosts, or too few formulas: simulate every candidate, the rules' first.
        if baseline not in candidates or size > SIM_MAX_RANKS:
            return None
        if len(candidates) == 1 and whole <= SEGMENTS[0]:
            return None  # nothing to choose
        if hosts is None:
            net = sim.from_profile(profile, size)
        else:
            per_host = size // hosts.n_hosts
            if profile.inter is None or hosts.hosts != tuple(r // per_host for r in range(size)):
                return None  # no inter link; uneven, or not numbered host by host
            net = sim.from_profile(profile, size, ranks_per_host=per_host)
        search = _Search(collective, size, whole, net, commutative, hosts)
        assert baseline is not None
        if search.time(baseline, default_segment) is None:
            return None
        for name in candidates:
            if name != baseline:
                search.time(name, default_segment)
        finalists = search.best(FINALISTS)
    if whole > SEGMENTS[0]:
        # Largest segments first (fewest steps), each for every finalist in turn,
        # so a tight budget is shared out rather than spent on one algorithm.
        for seg in sorted(SEGMENTS, reverse=True):
            if seg != default_segment and seg < whole:
                for name in finalists:
                    search.time(name, seg)
    (name, seg), t = search.best_pair()
    return Prediction(name, seg, t, "simulator")


def _formula_ranking(
    collective: str, size: int, whole: int, candidates: tuple[str, ...], profile: Profile
) -> list[tuple[float, str]]:
    """(closed-form time, name) of the candidates with a formula, fastest first (stable)."""
    times: list[tuple[float, str]] = []
    for name in candidates:
        t = formula_time(collective, name, size, whole, profile, profile.intra)
        if t is not None:
            times.append((t, name))
    times.sort(key=lambda tn: tn[0])  # stable: ties keep the candidates' order
    return times


class _Search:
    """Simulated times of (algorithm, segment) candidates of one call, within a step budget.

    The budget is counted in simulated steps, never in wall time, so every rank
    skips the same candidates.
    """

    def __init__(
        self,
        collective: str,
        size: int,
        whole: int,
        network: Network,
        commutative: bool,
        hosts: HostLayout | None = None,
    ) -> None:
        self.collective = collective
        self.size = size
        self.whole = whole
        self.network = network
        self.commutative = commutative
        self.hosts = hosts
        self.left = SIM_STEPS
        self.times: dict[tuple[str, int], float] = {}  # in the order simulated
        self._rank0: dict[tuple[str, int], int] = {}  # steps of rank 0's schedule

    def _rank0_steps(self, name: str, segment: int) -> list[int]:
        """Element counts of rank 0's steps (itemsize 1: elements are bytes)."""
        count = _collective(self.collective).unit_count(self.whole, self.size)
        ctx = Context(
            self.collective, 0, self.size, count, 1, self.commutative, 0, segment, self.hosts
        )
        return [s.count for s in build_schedule(get(self.collective, name), ctx).steps]

    def time(self, name: str, segment: int) -> float | None:
        """The simulated time of ``name`` at ``segment`` bytes; None if skipped.

        Skipped: over the budget left, the same schedule as a segment already
        timed (segments larger than every message), or not simulable.
        """
        key = (name, segment)
        if key in self.times:
            return self.times[key]
        try:
            whole_steps = self._rank0_steps(name, 0)
            estimate = self.size * sum(max(1, -(-c // segment)) for c in whole_steps)
            if estimate > self.left:
                return None
            n0 = len(self._rank0_steps(name, segment))
            if any(n == n0 for (other, _), n in self._rank0.items() if other == name):
                return None  # cut the same way as a segment already timed
            if n0 * self.size > self.left:
                return None
            self._rank0[key] = n0
            from plait import sim

            res = sim.simulate(
                self.collective,
                name,
                self.whole,
                self.network,
                dtype="u1",
                segment_bytes=segment,
                op=None if self.commutative else _NONCOMMUTATIVE,
                workers=1,
            )
        except Exception as exc:  # an algorithm the simulator cannot run here: not a candidate
            _log.debug("auto: cannot simulate %s/%s: %s", self.collective, name, exc)
            return None
        self.left -= res.steps
        self.times[key] = res.time
        return res.time

    def best(self, k: int) -> list[str]:
        """The ``k`` fastest algorithms timed so far (each at its best segment)."""
        best: dict[str, float] = {}
        for (name, _), t in self.times.items():
            if t < best.get(name, float("inf")):
                best[name] = t
        return sorted(best, key=lambda n: best[n])[:k]  # stable: ties keep the order timed

    def best_pair(self) -> tuple[tuple[str, int], float]:
        """The fastest (algorithm, segment) timed, and its time (ties: the first timed)."""
        key = min(self.times, key=lambda k: self.times[k])
        return key, self.times[key]


def _noncommutative_sum() -> Any:
    import numpy as np

    from plait.ops import Op

    return Op(np.add, commutative=False, name="sum (in rank order)")


_NONCOMMUTATIVE = _noncommutative_sum()
