"""The measured cost model behind ``algorithm="auto"``: α, β, γ per link class.

A :class:`Profile` holds, for each class of link (``intra``: ranks on one
host; ``inter``: across hosts), the per-message latency α (seconds) and the
per-byte time β (seconds per byte), plus the per-byte cost of reducing (γ)
and of copying (δ) on a rank. ``plait tune`` measures them on the machine it
runs on and writes them to a profile file (:func:`default_path`, or
PLAIT_PROFILE); every later run loads it.

With a profile, ``auto`` predicts each candidate algorithm's time with the
closed-form α-β-γ costs of plait's own schedules (:mod:`plait.sim.formulas`,
the formulas the simulator is tested against) and runs the fastest. The
prediction needs only values every rank knows (collective, ranks, bytes, the
op's commutativity and the profile), so every rank picks the same algorithm,
provided every rank loads the same profile (as with PLAIT_ALGO, ranks that
disagree fail with MismatchError rather than exchange garbage). Calls the
formulas do not cover (ranks on several hosts, collectives with a single
candidate) keep the built-in rules.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LinkCost", "Profile", "default_path", "load", "predict_best", "save"]

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
    def from_json(cls, data: dict[str, Any]) -> Profile:
        """The profile a :meth:`to_json` dict describes.

        Raises:
            ValueError: another format version, or missing or negative fields.
        """
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
    from plait.sim import formulas

    whole = nbytes * size if collective in _BLOCK else nbytes
    link = profile.intra
    best: tuple[str, float] | None = None
    covered = 0
    for name in candidates:
        try:
            t = formulas.predict(
                collective, name, size, whole, link.alpha, link.beta, profile.gamma, profile.delta
            )
        except KeyError:
            continue
        covered += 1
        if best is None or t < best[1]:
            best = (name, t)
    return best if covered >= 2 else None


_BLOCK = frozenset({"reduce_scatter", "allgather", "alltoall", "gather", "scatter"})
