"""List every collective's algorithms with the first line of each builder's docstring."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``plait algorithms``."""
    parser.add_argument("collective", nargs="?", help="only this collective")


def main(args: argparse.Namespace) -> int:
    """Print the table."""
    from plait.algos._registry import COLLECTIVES, specs

    chosen = [args.collective] if args.collective else list(COLLECTIVES)
    for c in chosen:
        for spec in specs(c):
            flags = " (commutative ops only)" if spec.commutative_only else ""
            print(f"{c:15} {spec.name:20} {spec.summary}{flags}")
    return 0
