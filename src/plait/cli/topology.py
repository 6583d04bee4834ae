"""The networks of ``plait sim --topology``: a topology's text, checked, made a Network.

The forms and what each models are listed in :mod:`plait.cli.sim`'s help;
docs/simulator.md says more.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["MACHINE_A_RANK", "parse_topology"]

#: The networks (by :attr:`plait.sim.Network.name`) that join a machine a rank by cables:
#: none of their ranks shares a host's memory with another.
MACHINE_A_RANK = frozenset({"single_switch", "fat_tree", "torus", "ring"})


def parse_topology(
    spec: str,
    p: int,
    alpha: float,
    beta: float,
    gamma: float,
    intra: tuple[float, float],
    aggregation: int = 0,
    *,
    delta: float | None = None,
    wait_latency: float | None = None,
) -> Any:
    """The :class:`plait.sim.Network` a ``--topology`` string names (see the module doc).

    ``gamma`` and ``delta``: every rank's reduction and copy cost, s/B (``delta``
    None: ``gamma``, as in :mod:`plait.sim.topologies`). ``aggregation``: bytes of
    aggregation memory per switch (0: switches do not reduce). ``wait_latency``:
    seconds until a post is seen by the peers (:meth:`plait.sim.Network.set_wait_latency`;
    None: a message's latency between the two ranks).

    Raises:
        ValueError: an unknown topology or bad parameters (the message says which).
    """
    _check_costs(
        ("--alpha", alpha, "per message"),
        ("--beta", beta, "per byte"),
        ("--gamma", gamma, "per byte"),
        ("--delta", delta, "per byte"),
        ("--intra-alpha", intra[0], "per message"),
        ("--intra-beta", intra[1], "per byte"),
        ("--wait-latency", wait_latency, ""),
    )
    try:
        net = _topology(spec, p, alpha, beta, gamma, delta, intra, aggregation)
    except ValueError as exc:
        text = str(exc)
        if text.startswith(("--", "unknown topology")):
            raise
        name = spec.partition(":")[0]
        raise ValueError(f"--topology {spec!r}: {text}; expected {_FORMS[name][1]}") from None
    net.set_wait_latency(wait_latency)
    return net


def _check_costs(*costs: tuple[str, float | None, str]) -> None:
    """ValueError naming the option of the first cost that is not a finite number >= 0.

    Each cost is ``(option, seconds, per what)``; None is not given (a default applies).
    Checked here, by option, since the network's own checks name its arguments: an
    ``--intra-alpha`` of -1 reached the user as a bad ``--alpha``, a ``--gamma`` as a bad
    ``--topology``.
    """
    for option, value, per in costs:
        if value is not None and not (np.isfinite(value) and value >= 0):
            unit = f"seconds {per}" if per else "seconds"
            raise ValueError(f"{option} must be a finite number >= 0 ({unit}); got {value!r}")


def _parameter(text: str, kind: type[int] | type[float], what: str) -> Any:
    """A ``--topology`` parameter ``text`` as ``kind``; ValueError naming ``what`` if not."""
    try:
        return kind(text)
    except ValueError:
        expected = "a whole number" if kind is int else "a number"
        raise ValueError(f"{what} {text!r} is not {expected}") from None


#: Per topology, how many ``:``-separated parameters it takes at most, and its form.
_FORMS = {
    "flat": (0, "flat"),
    "flat-free": (0, "flat-free"),
    "switch": (0, "switch"),
    "ring": (0, "ring"),
    "fat-tree": (3, "fat-tree:K[:OVERSUB[:SPINES]]"),
    "hosts": (2, "hosts:K[:NICS]"),
    "torus": (1, "torus:AxB[xC...]"),
}


def _topology(
    spec: str,
    p: int,
    alpha: float,
    beta: float,
    gamma: float,
    delta: float | None,
    intra: tuple[float, float],
    aggregation: int,
) -> Any:
    """The network :func:`parse_topology` returns, before it sets the wait latency."""
    from plait import sim

    name, colon, rest = spec.partition(":")
    args = [a for a in rest.split(":") if a] if rest else []
    if name in _FORMS and (len(args) > _FORMS[name][0] or (colon and not _FORMS[name][0])):
        most, form = _FORMS[name]
        takes = "no parameters" if not most else f"at most {most} parameter{'s' * (most > 1)}"
        raise ValueError(f"--topology {spec!r}: {name} takes {takes}; expected {form}")
    link = sim.LinkParams(alpha, beta)
    if aggregation and name not in ("switch", "fat-tree", "hosts"):
        raise ValueError(
            f"--aggregation needs switches: use it with switch, fat-tree or hosts, not {name}"
        )
    if name == "flat":
        return sim.flat(p, alpha, beta, gamma, delta=delta)
    if name == "flat-free":
        return sim.flat(p, alpha, beta, gamma, delta=delta, ports=False)
    if name == "switch":
        return sim.single_switch(p, link, gamma=gamma, delta=delta, aggregation_memory=aggregation)
    if name == "fat-tree":
        if not args:
            raise ValueError("fat-tree needs ranks per leaf: fat-tree:K[:OVERSUB[:SPINES]]")
        k = _parameter(args[0], int, "K")
        over = _parameter(args[1], float, "OVERSUB") if len(args) > 1 else 1.0
        spines = _parameter(args[2], int, "SPINES") if len(args) > 2 else 1
        return sim.fat_tree(
            p, k, link, oversubscription=over, spines=spines, gamma=gamma, delta=delta,
            aggregation_memory=aggregation,
        )  # fmt: skip
    if name == "hosts":
        if not args:
            raise ValueError("hosts needs ranks per host: hosts:K[:NICS]")
        k = _parameter(args[0], int, "K")
        if k < 1:
            raise ValueError(f"K must be at least 1 rank per host; got {k}")
        if p % k:
            raise ValueError(f"--ranks {p} is not a multiple of {k} ranks per host")
        nics = _parameter(args[1], int, "NICS") if len(args) > 1 else 1
        return sim.hosts(
            p // k, k, sim.LinkParams(*intra), link, nics=nics, gamma=gamma, delta=delta,
            aggregation_memory=aggregation,
        )  # fmt: skip
    if name == "ring":
        return sim.ring(p, link, gamma=gamma, delta=delta)
    if name == "torus":
        if not args:
            raise ValueError("torus needs its dimensions: torus:AxB[xC...]")
        dims = [_parameter(d, int, "a dimension") for d in args[0].lower().split("x")]
        if int(np.prod(dims)) != p:
            raise ValueError(f"torus {args[0]} has {int(np.prod(dims))} ranks, not --ranks {p}")
        return sim.torus(dims, link, gamma=gamma, delta=delta)
    raise ValueError(
        f"unknown topology {spec!r}; expected flat, flat-free, switch, fat-tree:K, hosts:K, "
        "ring or torus:AxB"
    )
