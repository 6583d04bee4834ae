"""The α-β-γ cost parameters of links and ranks.

Notation of Thakur, Rabenseifner and Gropp (2005):

* ``α`` (``alpha``): the latency of a message, seconds;
* ``β`` (``beta``): seconds per byte (the inverse of a bandwidth);
* ``γ`` (``gamma``): seconds per byte a rank spends reducing (``RECV_REDUCE``, ``REDUCE``,
  and ``GET_REDUCE``, which reduces straight from a peer's window on the host);
* ``δ`` (``delta``): seconds per byte a rank spends copying (``COPY``, and ``GET``, which
  copies from a peer's window). The paper has no such term (its algorithms copy
  nothing); plait's schedules do copy (an allreduce starts by copying its input
  into the output), so the simulator charges it. It defaults to ``γ``: both are
  bound by memory bandwidth.

Both are a rank's local work, charged to every algorithm alike (a ring's
receive-and-reduce costs γ per byte as an arena's get-and-reduce does). The
topologies default them to 0 (the network alone, as in the paper); ``plait sim``
defaults them to a typical host's, 15 GB/s each (docs/simulator.md, "Host
memory", says how that was measured).

A link's α and β are a :class:`LinkParams`. The measured model of a machine,
one α-β per link class plus γ and δ, is :class:`plait.selection.model.Profile`
(written by ``plait tune``); :func:`plait.sim.from_profile` builds the network
it describes, so the selector and the simulator share one set of numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LinkParams"]


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
