"""Where a host's ranks outnumber the CPUs they may use: each rank's calling thread on one
CPU of its own share, in turn (Note [binding crowded ranks]).

Note [binding crowded ranks]
    With more ranks on a host than CPUs, a waiting rank gives its core up
    (``os.sched_yield``, Note [a second look] in :mod:`plait.runtime.compiled`)
    so that a rank sharing the core can run. That works where the ranks are
    spread evenly over the cores; the kernel often puts three of four ranks on
    one of two cores for seconds at a time, and then the lone rank's yields
    return at once (nobody else wants its core) while three ranks share the
    other: 4 ranks on 2 cores took 24-35 µs an 8-byte allreduce placed so,
    18-19 µs two to a core (docs/performance.md). So ``plait.init`` binds the
    thread that makes the communicator (the one that then runs its calls, and
    whatever threads it starts later) to one CPU: the ``i``-th rank of the host
    to the ``i mod n``-th of the ``n`` CPUs the process may use. Only where the
    ranks outnumber those CPUs: with a CPU each, the kernel keeps them apart,
    and a rank's numpy may use more than one. ``PLAIT_BIND=0`` (or ``false``, ``off``) leaves the
    affinity alone (a launcher that binds ranks itself, two jobs sharing one
    host's CPUs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from plait._checks import env_switch

__all__ = ["bind_crowded"]


def bind_crowded(
    rank: int, hosts: Sequence[str], env: Mapping[str, str] = os.environ
) -> int | None:
    """Bind the calling thread to one CPU where this host's ranks outnumber the CPUs it
    may use (Note [binding crowded ranks]); the CPU, or None where it left it alone.

    ``hosts[r]`` is rank ``r``'s host; this rank's host is ``hosts[rank]``.
    """
    if not env_switch(env, "PLAIT_BIND", True):
        return None
    getaffinity = getattr(os, "sched_getaffinity", None)
    setaffinity = getattr(os, "sched_setaffinity", None)
    if getaffinity is None or setaffinity is None:  # not Linux
        return None
    mine = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    try:
        cpus: list[int] = sorted(getaffinity(0))
    except OSError:
        return None
    if len(mine) <= len(cpus) or len(cpus) < 2:
        return None
    cpu: int = cpus[mine.index(rank) % len(cpus)]
    try:
        setaffinity(0, {cpu})
    except OSError:  # a cpuset that changed meanwhile: leave it to the kernel
        return None
    return cpu
