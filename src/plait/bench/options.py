"""The options ``plait bench`` and ``plait sim`` share, spelled alike in both commands.

One vocabulary for the concepts both commands have, so that a sweep moves from
one to the other by changing the command name:

================================  ===========================================
the collective                    ``COLLECTIVE`` (positional) or ``-c/--collective``
ranks                             ``-n/--ranks`` (old spelling ``--nproc``)
sizes                             ``-b/--begin``, ``-e/--end``, ``-f/--factor``
                                  (nccl-tests' letters), or ``-s/--sizes LO[:HI]``
element type, reduction, root     ``-d/--dtype``, ``-o/--op``, ``-r/--root``
algorithms                        ``-a/--algo`` (old spelling ``--algorithm``)
files                             ``--json``, ``--csv``, ``--plot``
progress on stderr                ``--progress/--no-progress``
================================  ===========================================

Old spellings stay accepted as hidden aliases. ``-t`` is the transport (as in
``plait bench``); ``plait sim`` spells its topology ``--topology`` and takes an
old ``-t TOPOLOGY`` with a note on stderr.

Defaults differ between the commands (a benchmark and a simulator want
different sweeps), so the size and collective options are parsed to None here
and resolved by :func:`resolve_collective` and :func:`resolve_sizes`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DeprecatedAlias",
    "add_algorithms",
    "add_alias",
    "add_collective",
    "add_outputs",
    "add_progress",
    "add_ranks",
    "add_reduction",
    "add_sizes",
    "algorithm_listing",
    "resolve_collective",
    "resolve_sizes",
]


def add_alias(parser: argparse.ArgumentParser, *flags: str, dest: str, **kwargs: Any) -> None:
    """An old spelling of an option: accepted, not shown in ``--help``.

    ``default=SUPPRESS`` leaves the default to the option it is an alias of.
    """
    parser.add_argument(
        *flags, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs
    )


class DeprecatedAlias(argparse.Action):
    """An old spelling that still works, with a note on stderr saying what to write instead.

    For a short flag whose letter now means something else in the sister command
    (``plait sim -t`` for the topology, while ``-t`` is ``plait bench``'s transport).
    """

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        instead: str = "",
        why: str = "",
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("default", argparse.SUPPRESS)
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.instead = instead
        self.why = why

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        """Store the value as the new spelling would, and say so on stderr."""
        why = f" ({self.why})" if self.why else ""
        print(
            f"{parser.prog}: {option_string} is deprecated here; write {self.instead}{why}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_collective(parser: argparse.ArgumentParser, default: str) -> None:
    """The collective, as a positional argument (``plait bench allgather``) or ``-c``."""
    from plait.bench.sweep import COLLECTIVES

    parser.add_argument(
        "_collective",
        nargs="?",
        default=None,
        metavar="COLLECTIVE",
        help=f"the collective: {', '.join(COLLECTIVES)} (default {default})",
    )
    parser.add_argument(
        "-c",
        "--collective",
        default=None,
        metavar="COLLECTIVE",
        help="the same, as an option",
    )


def resolve_collective(args: argparse.Namespace, default: str) -> str:
    """The collective named by the positional argument or ``-c`` (one of them), else ``default``.

    Raises:
        ValueError: two different collectives, or an unknown one.
    """
    from plait.bench.sweep import COLLECTIVES

    given = [c for c in (getattr(args, "_collective", None), args.collective) if c is not None]
    if len(set(given)) > 1:
        raise ValueError(f"two collectives given: {given[0]} and -c {given[1]}; give one")
    c = given[0] if given else default
    if c not in COLLECTIVES:
        raise ValueError(f"unknown collective {c!r}; expected one of {', '.join(COLLECTIVES)}")
    return c


def add_ranks(parser: argparse.ArgumentParser, dest: str, default: int) -> None:
    """``-n/--ranks`` (``--nproc`` kept as an alias, as ``plait run`` spells it)."""
    parser.add_argument(
        "-n", "--ranks", dest=dest, type=int, default=default, metavar="N",
        help=f"number of ranks (default {default})",
    )  # fmt: skip
    add_alias(parser, "--nproc", dest=dest, type=int)


def add_sizes(parser: argparse.ArgumentParser, begin: str, end: str, factor: int) -> None:
    """``-b/-e/-f`` as in nccl-tests, and ``-s LO[:HI]`` for both ends at once."""
    parser.add_argument(
        "-b", "--begin", default=None, metavar="SIZE",
        help=f"smallest size in bytes, with K, M, G suffixes (default {begin})",
    )  # fmt: skip
    parser.add_argument(
        "-e", "--end", default=None, metavar="SIZE", help=f"largest size (default {end})"
    )
    parser.add_argument(
        "-f", "--factor", type=int, default=None, metavar="F",
        help=f"each size is the previous one times F (default {factor})",
    )  # fmt: skip
    parser.add_argument(
        "-s", "--sizes", default=None, metavar="LO[:HI]",
        help="-b LO -e HI in one option; one size alone: that size only",
    )  # fmt: skip


def resolve_sizes(
    args: argparse.Namespace, begin: str, end: str, factor: int
) -> tuple[int, int, int, list[int]]:
    """``(begin, end, factor, sizes)`` from ``-b/-e/-f`` or ``-s``, with the command's defaults.

    Raises:
        ValueError: ``-s`` together with ``-b`` or ``-e``, a bad size, begin > end, F < 2.
    """
    from plait.bench.sweep import parse_size, size_range

    lo, hi = args.begin, args.end
    if args.sizes is not None:
        if lo is not None or hi is not None:
            raise ValueError("give the sizes either as -s LO:HI or as -b LO -e HI, not both")
        lo, _, hi = args.sizes.partition(":")
        hi = hi or lo
    b = parse_size(lo if lo is not None else begin)
    e = parse_size(hi if hi is not None else end)
    f = args.factor if args.factor is not None else factor
    if f < 2:
        raise ValueError(f"-f must be at least 2, got {f}")
    return b, e, f, size_range(b, e, f)


def add_algorithms(parser: argparse.ArgumentParser, dest: str, default: str, text: str) -> None:
    """``-a/--algo`` (``--algorithm`` kept as an alias)."""
    parser.add_argument("-a", "--algo", dest=dest, default=default, metavar="ALGO", help=text)
    add_alias(parser, "--algorithm", dest=dest)


def add_reduction(parser: argparse.ArgumentParser) -> None:
    """``-d/--dtype``, ``-o/--op`` and ``-r/--root``."""
    parser.add_argument(
        "-d", "--dtype", default="float32",
        help="numpy dtype, e.g. float32 (default), float64, int32, bfloat16",
    )  # fmt: skip
    parser.add_argument(
        "-o", "--op", default="sum",
        help="reduction: sum (default), prod, min, max, avg, band, bor or bxor",
    )  # fmt: skip
    parser.add_argument(
        "-r", "--root", type=int, default=0,
        help="root rank of reduce, broadcast, gather and scatter (default 0)",
    )  # fmt: skip


def add_outputs(parser: argparse.ArgumentParser) -> None:
    """``--json``, ``--csv``, ``--plot``."""
    parser.add_argument("--json", metavar="FILE", help="write every result as JSON")
    parser.add_argument("--csv", metavar="FILE", help="write one line per row as CSV")
    parser.add_argument(
        "--plot", metavar="FILE", help="draw busbw and time against size (PNG, SVG, PDF)"
    )


def add_progress(parser: argparse.ArgumentParser, text: str) -> None:
    """``--progress/--no-progress`` (default None: the command decides)."""
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help=text
    )


#: Why an algorithm is marked in the listings: it cannot run on plait's transports.
NEEDS_SWITCHES = (
    "simulator only: needs aggregating switches (switches that reduce in flight, as SHARP "
    "and SwitchML do)"
)


def algorithm_listing(note: str) -> str:
    """Every collective's algorithms, those that need switches marked with ``*``.

    For the end of ``--help`` (plain text, lines of at most 79 characters);
    ``note`` follows the explanation of the mark (what the command does with them).
    """
    import textwrap

    import plait
    from plait.algos import get

    lines = ["algorithms (-a) of each collective:"]
    marked = False
    for c in plait.COLLECTIVES:
        names = []
        for a in plait.algorithms(c):
            fabric = get(c, a).needs_fabric
            names.append(a + "*" if fabric else a)
            marked = marked or fabric
        lines += textwrap.wrap(
            ", ".join(names), 79, initial_indent=f"  {c:16}", subsequent_indent=" " * 18
        )
    if marked:
        lines += textwrap.wrap(f"* {NEEDS_SWITCHES}; {note}", 79, subsequent_indent="  ")
    return "\n".join(lines)
