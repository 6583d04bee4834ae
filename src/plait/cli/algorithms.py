"""List every collective's algorithms with the first line of each builder's docstring.

A note in parentheses after a line gives the algorithm's restrictions:
"commutative ops only", or "simulator only: needs aggregating switches" for an
algorithm that only plait sim can run (a communicator refuses it).
"""

# The docstring above is `plait algorithms --help`: plain text, no reStructuredText markup.

from __future__ import annotations

import argparse

from plait.cli import plain

__all__ = ["add_arguments", "main", "plain"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``plait algorithms``."""
    parser.add_argument(
        "collective",
        nargs="?",
        choices=_all(),
        metavar="COLLECTIVE",
        help="only this collective: " + ", ".join(_all()),
    )


def _all() -> tuple[str, ...]:
    """Every collective with algorithms: the even ones, then the uneven (``allgatherv``...)."""
    from plait.algos._registry import COLLECTIVES, UNEVEN_COLLECTIVES

    return (*COLLECTIVES, *UNEVEN_COLLECTIVES)


def main(args: argparse.Namespace) -> int:
    """Print the table."""
    from plait.algos._registry import SIMULATOR_ONLY, specs

    chosen = [args.collective] if args.collective else list(_all())
    for c in chosen:
        for spec in specs(c):
            notes = [SIMULATOR_ONLY] if spec.needs_fabric else []
            if spec.host_windows:
                notes.append("a shared-memory window on each host of several ranks")
            elif spec.needs_window:
                notes.append("one host: a shared-memory window")
            if spec.commutative_only:
                notes.append("commutative ops only")
            flags = f" ({'; '.join(notes)})" if notes else ""
            print(f"{c:15} {spec.name:20} {plain(spec.summary)}{flags}")
    return 0
