"""The dissemination barrier (Hensgen, Finkel & Manber 1988): ⌈lg p⌉ rounds for any p.

In round ``k`` every rank signals the rank ``2**k`` places after it and waits
for the one ``2**k`` places before it. A rank signals in round ``k`` only after
all its earlier rounds, so after round ``k`` it has heard, directly or
transitively, from the ``2**(k+1) - 1`` ranks before it; after ⌈lg p⌉ rounds,
from everyone. Unlike a tree barrier there is no root and no second (release)
phase, and p need not be a power of two.

A signal is a one-element token (the builder drops empty messages). Each round
receives into a fresh token, so receives can be posted at once and never wait
for the rank's own send, and then copies it into a running token that the next
round sends: that copy orders each send after every earlier receive, which is
what carries the knowledge on. The tokens' values mean nothing.

Cost (p ranks): ⌈lg p⌉α (one-element messages; the copies are negligible).
Restrictions: none; any p.

Example, p=5 (rounds at distances 1, 2, 4):

    round 0: 0→1 1→2 2→3 3→4 4→0     each rank has heard from r-1
    round 1: 0→2 1→3 2→4 3→0 4→1     ... from r-1 .. r-3
    round 2: 0→4 1→0 2→1 3→2 4→3     ... from r-1 .. r-7: all 5
"""

from __future__ import annotations

from plait.algos._presence import signal_all
from plait.algos._registry import register
from plait.algos.topology import dissemination_peers
from plait.schedule.builder import Builder

__all__ = ["dissemination_peers"]


@register("barrier", "dissemination")
def barrier(b: Builder) -> None:
    """Dissemination barrier: signal rank r+2^k, wait for r-2^k, for ⌈lg p⌉ rounds."""
    signal_all(b)
