"""Closed-form α-β-γ costs of plait's schedules on the flat network, after Thakur et al. (2005).

An algorithm's formula sits in its own module, next to its builder, and is
attached to its registration as a :class:`Cost` (``@register(..., cost=...)``);
:mod:`plait.selection.model` ranks ``auto``'s candidates with them, and
:mod:`plait.sim.formulas` looks them up by (collective, algorithm). This module
holds what they share: the :class:`Cost` record, the :data:`Formula` signature
and :func:`lg`.

Each formula gives the time of one call on :func:`plait.sim.flat` with
``ports=False`` (every message costs α + nβ, whatever else is in flight),
without pipelining (one segment), with γ seconds per byte reduced and δ per
byte copied, for ``p`` ranks and a buffer of ``n`` bytes (the collective's
whole buffer, as :func:`plait.sim.context_count` reads it). Blocks are assumed
equal: the element count divides evenly among the ranks (and among the
``q = pof2_floor(p)`` virtual ranks where an algorithm folds).

They are the formulas of Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH" (IJHPCA 19(1), 2005), rederived
for what plait's schedules actually do. Where they differ, the function says
why; the differences come from four things the paper's model does not have:

* **Local copies** (δ). plait copies the input into the output (or scratch)
  before reducing in place, and copies results out of scratch; the paper's
  algorithms copy nothing. With δ = 0 the formulas reduce to the paper's
  wherever the schedules otherwise agree.
* **Concurrent messages.** The paper's processes send one message at a time
  (blocking sends in a fixed order). plait's schedules only order what data
  dependencies order, so a rank may have several messages in flight (binomial
  broadcast, pairwise exchange, Bruck's short last step): their latencies
  overlap, so it is paid once, not once per message. Contention-free, they do
  not slow each other at all; with ports they share the rank's port, and the
  bandwidth term counts every byte through the busiest port.
* **Early data.** A receive-and-reduce accepts its message before its
  dependencies are done (as the executor stages it), so a rank that starts
  late catches up on partners that started early; only the longest chain of
  dependent messages counts (a max over paths, written out below).
* **Folding.** For p not a power of two the first ``2(p - q)`` ranks pair up and
  fold into ``q`` virtual ranks (Thakur et al.'s scheme for allreduce);
  plait folds the same way in recursive doubling (allgather too, where the
  paper has a different scheme), Rabenseifner and recursive halving. Where
  the folded virtual ranks then carry windows of uneven size, the formula is
  a max-plus recurrence over the q virtual ranks instead of a closed form.

Two network models (:func:`plait.sim.flat`):

* ``ports=False``, contention-free, the paper's: a message costs α + nβ however
  many others are in flight. Every :attr:`Cost.flat` holds for every p.
* ``ports=True``, the default: each rank's messages share its send and its
  receive port. :attr:`Cost.ports` is what holds there: the ring algorithms
  for every p; powers of two for everything whose ranks never have two
  messages in (or out) at once; and port-aware versions of the algorithms
  that send to several peers at once (binomial broadcast, pairwise).
  Folding (p not a power of two) puts two messages into one port at once
  (the fold's and an early partner's), which these formulas do not model.

Every formula is checked against the simulator to 1e-9 relative in
``tests/sim/test_formulas.py``, for p = 1..33 and four regimes of α, β, γ, δ.
The formulas' arguments are ``(p, n, a, b, g, d)``: ranks, bytes, α, β, γ, δ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Cost", "Formula", "lg"]

#: ``(p, n, α, β, γ, δ) -> seconds``: one call on p ranks with a whole buffer of n bytes.
Formula = Callable[[int, float, float, float, float, float], float]


def lg(q: int) -> int:
    """⌊log2 q⌋ for q >= 1 (the number of hypercube steps when q is a power of two)."""
    return q.bit_length() - 1


@dataclass(frozen=True, slots=True)
class Cost:
    """An algorithm's closed-form time on :func:`plait.sim.flat`, unsegmented.

    Attributes:
        flat: on the contention-free network (``ports=False``), for every p;
            None where only the model with ports has a formula.
        ports: on the network with ports (``ports=True``); None where none holds.
        ports_pow2: whether ``ports`` holds only when p is a power of two.
    """

    flat: Formula | None = None
    ports: Formula | None = None
    ports_pow2: bool = False

    def time(
        self,
        p: int,
        nbytes: float,
        alpha: float,
        beta: float,
        gamma: float,
        delta: float | None = None,
        *,
        ports: bool = False,
    ) -> float | None:
        """Seconds for ``p`` ranks and ``nbytes``; None where no formula holds.

        ``delta`` (copy cost) defaults to ``gamma``, as on :func:`plait.sim.flat`.
        """
        d = gamma if delta is None else delta
        formula = self.flat
        if ports:
            formula = None if self.ports_pow2 and p & (p - 1) else self.ports
        return None if formula is None else formula(p, float(nbytes), alpha, beta, gamma, d)
