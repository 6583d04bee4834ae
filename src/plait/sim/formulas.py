"""The closed-form α-β-γ costs of plait's schedules, looked up by (collective, algorithm).

Each formula lives in its algorithm's module and is attached to its
registration (``AlgorithmSpec.cost``, a :class:`plait.algos._cost.Cost`,
whose docstring describes the model and how the formulas differ from Thakur,
Rabenseifner and Gropp 2005). This module gives them the addresses the
simulator's tests and tools use: :func:`predict`, and :data:`COVERED` and
:data:`ON_PORTS`, which list what holds on :func:`plait.sim.flat` without and
with ports. Every formula is checked against the simulator to 1e-9 relative
in ``tests/sim/test_formulas.py``, for p = 1..33.
"""

from __future__ import annotations

from plait.algos._cost import Formula
from plait.algos._registry import COLLECTIVES, get, specs

__all__ = ["COVERED", "ON_PORTS", "predict"]

#: On the contention-free flat network (``ports=False``): every formula, any p.
COVERED: dict[tuple[str, str], Formula] = {
    (s.collective, s.name): s.cost.flat
    for c in COLLECTIVES
    for s in specs(c)
    if s.cost is not None and s.cost.flat is not None
}

#: On the flat network with ports: (formula, "any" p or only "pow2").
ON_PORTS: dict[tuple[str, str], tuple[Formula, str]] = {
    (s.collective, s.name): (s.cost.ports, "pow2" if s.cost.ports_pow2 else "any")
    for c in COLLECTIVES
    for s in specs(c)
    if s.cost is not None and s.cost.ports is not None
}


def predict(
    collective: str,
    algorithm: str,
    p: int,
    nbytes: float,
    alpha: float,
    beta: float,
    gamma: float,
    delta: float | None = None,
    *,
    ports: bool = False,
) -> float:
    """The formula's time for ``collective``/``algorithm`` on ``p`` ranks and ``nbytes``.

    ``ports=False`` is :func:`plait.sim.flat` with ``ports=False`` (contention-free,
    every formula, any p); ``ports=True`` the flat network with ports, where
    :data:`ON_PORTS` says which formulas hold and for which p. ``delta`` (copy
    cost) defaults to ``gamma``, as on :func:`plait.sim.flat`.

    Raises:
        KeyError: no formula for that algorithm, model and p.
    """
    try:
        cost = get(collective, algorithm).cost
    except ValueError:
        cost = None
    t = None if cost is None else cost.time(p, nbytes, alpha, beta, gamma, delta, ports=ports)
    if t is not None:
        return t
    if not ports:
        raise KeyError(
            f"no formula for {collective}/{algorithm}; covered: "
            + ", ".join(f"{c}/{a}" for c, a in COVERED)
        )
    raise KeyError(f"no formula for {collective}/{algorithm} with ports at p = {p}")
