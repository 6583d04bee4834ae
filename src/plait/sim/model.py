"""The α-β-γ cost parameters: one latency/bandwidth pair per link class, and local work per byte.

Notation of Thakur, Rabenseifner and Gropp (2005):

* ``α`` (``alpha``): the latency of a message, seconds;
* ``β`` (``beta``): seconds per byte (the inverse of a bandwidth);
* ``γ`` (``gamma``): seconds per byte a rank spends reducing (``RECV_REDUCE``, ``REDUCE``);
* ``δ`` (``delta``): seconds per byte a rank spends copying (``COPY``). The paper has no
  such term (its algorithms copy nothing); plait's schedules do copy (an allreduce
  starts by copying its input into the output), so the simulator charges it. It
  defaults to ``γ``: both are bound by memory bandwidth.

A :class:`CostModel` names the link classes a job's messages cross (``"intra"``
between ranks of one host, ``"inter"`` between hosts) so that the simulator,
the selector and a benchmark report can share one set of numbers; it reads and
writes plain dicts (JSON) for profile files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_MODEL", "CostModel", "LinkParams"]


@dataclass(frozen=True, slots=True)
class LinkParams:
    """Latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte) of a link or link class."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"LinkParams.{name} must be a finite number >= 0; got {value!r}")

    @classmethod
    def from_bandwidth(cls, latency: float, bytes_per_second: float) -> LinkParams:
        """Parameters of a link with this latency (s) and bandwidth (bytes/s)."""
        if not bytes_per_second > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s; got {bytes_per_second!r}")
        return cls(latency, 1.0 / bytes_per_second)

    @property
    def bandwidth(self) -> float:
        """Bytes per second (infinite for ``beta == 0``)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def time(self, nbytes: float) -> float:
        """``α + nβ``: the time of one message of ``nbytes`` alone on the link."""
        return self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class CostModel:
    """An α-β pair per link class plus the per-byte local costs γ (reduce) and δ (copy).

    Args:
        links: link class name -> :class:`LinkParams`; topologies that mix classes
            (e.g. :func:`plait.sim.hosts`) look up ``"intra"`` and ``"inter"``.
        gamma: seconds per byte of a reduction on a rank.
        delta: seconds per byte of a local copy; None means ``gamma``.
    """

    links: Mapping[str, LinkParams] = field(default_factory=dict)
    gamma: float = 0.0
    delta: float | None = None

    def __post_init__(self) -> None:
        for name in ("gamma", "delta"):
            value = getattr(self, name)
            if value is None and name == "delta":
                continue
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CostModel.{name} must be a finite number >= 0; got {value!r}")

    @property
    def copy(self) -> float:
        """δ, the effective copy cost per byte."""
        return self.gamma if self.delta is None else self.delta

    def link(self, klass: str) -> LinkParams:
        """The parameters of link class ``klass``; ValueError naming the known classes."""
        try:
            return self.links[klass]
        except KeyError:
            raise ValueError(
                f"cost model has no link class {klass!r}; it has: {', '.join(self.links) or 'none'}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_dict`)."""
        return {
            "links": {k: {"alpha": v.alpha, "beta": v.beta} for k, v in self.links.items()},
            "gamma": self.gamma,
            "delta": self.delta,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        """The model written by :meth:`to_dict`."""
        links = {
            k: LinkParams(float(v["alpha"]), float(v["beta"])) for k, v in data["links"].items()
        }
        delta = data.get("delta")
        return cls(links, float(data.get("gamma", 0.0)), None if delta is None else float(delta))


#: Rough defaults for a commodity cluster: shared memory inside a host (1 µs, 10 GB/s),
#: 10 Gb/s Ethernet between hosts (10 µs, 1.25 GB/s), reductions at 2 GB/s.
DEFAULT_MODEL = CostModel(
    {
        "intra": LinkParams(1e-6, 1 / 10e9),
        "inter": LinkParams(10e-6, 1 / 1.25e9),
    },
    gamma=1 / 2e9,
)
