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
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import numpy as np

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
    "check_elements",
    "check_outputs",
    "plot_formats",
    "resolve_collective",
    "resolve_dtype",
    "resolve_sizes",
    "usage",
    "usage_error",
]


def usage(args: argparse.Namespace, prog: str, message: str) -> int:
    """Say that the command was called wrongly, as argparse does; the exit code, 2.

    On stderr, through the subcommand's parser (``args._parser``, set by
    :mod:`plait.cli.__main__`) as when it refuses an option of the wrong type: the
    usage, then ``PROG: error: MESSAGE``. Arguments made without one (a test's) get
    that last line alone.
    """
    parser = getattr(args, "_parser", None)
    if isinstance(parser, argparse.ArgumentParser):
        parser.print_usage(sys.stderr)
        prog = parser.prog
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def usage_error(args: argparse.Namespace, prog: str, message: str) -> NoReturn:
    """:func:`usage`, then exit with its code: a usage error found below ``main``."""
    raise SystemExit(usage(args, prog, message))


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

    The largest size is :data:`plait.sim.MAX_BYTES`, 2**63 - 1 bytes, in both commands:
    the largest buffer numpy addresses and int64 offsets hold. Beyond it ``plait bench``
    failed in the ranks (exit 1) and ``plait sim`` overflowed (a wrong time, or a
    traceback); it is refused here, before anything runs.

    Raises:
        ValueError: ``-s`` together with ``-b`` or ``-e``, a bad size, a size above
            2**63 - 1 bytes, begin > end, F < 2.
    """
    from plait.bench.sweep import parse_size, size_range
    from plait.sim.call import MAX_BYTES

    lo, hi = args.begin, args.end
    if args.sizes is not None:
        if lo is not None or hi is not None:
            raise ValueError("give the sizes either as -s LO:HI or as -b LO -e HI, not both")
        lo, _, hi = args.sizes.partition(":")
        hi = hi or lo
    b = parse_size(lo if lo is not None else begin)
    e = parse_size(hi if hi is not None else end)
    f = args.factor if args.factor is not None else factor
    given = hi if hi is not None else end
    if e > MAX_BYTES:
        flag = "-s" if args.sizes is not None else "-e"
        raise ValueError(
            f"{flag}: {given} is {e} B, above the largest size, 2**63 - 1 B (int64's largest, "
            "as numpy addresses memory); expected a smaller size"
        )
    if f < 2:
        raise ValueError(f"-f must be at least 2, got {f}")
    return b, e, f, size_range(b, e, f)


def check_elements(
    args: argparse.Namespace, collective: str, sizes: Sequence[int], itemsize: int, ranks: int
) -> None:
    """Refuse sizes too small to hold an element: a sweep whose every row would be empty.

    A size holds ``count`` elements of ``args.dtype`` (``itemsize`` bytes each), rounded
    down to whole blocks of ``ranks`` for the block collectives (:mod:`plait.bench.sweep`).
    Smaller sizes of a sweep collapse onto its 0-byte row; but where even the largest
    size holds nothing (``-s 3`` of float32), the command would time or simulate nothing
    at all. ``-s 0`` (an empty row, on purpose) is accepted.

    Raises:
        ValueError: the largest size is above 0 and holds no element.
    """
    from plait import collectives
    from plait.bench.sweep import element_count

    described = collectives.get(collective)
    largest = max(sizes, default=0)
    if described.synchronizes or largest == 0:
        return
    if element_count(collective, largest, itemsize, ranks) > 0:
        return
    least = described.whole_count(1, ranks) * itemsize
    element = f"one {args.dtype} element"
    what = (
        f"{element} ({itemsize} B)"
        if least == itemsize
        else f"{element} per rank ({ranks} ranks of {itemsize} B: {least} B)"
    )
    flag = "-s" if args.sizes is not None else "-e"
    raise ValueError(
        f"{flag}: {largest} B is below {what}, so no row would hold data; "
        f"give sizes of at least {least} B (or 0 for an empty row)"
    )


def resolve_dtype(args: argparse.Namespace, collective: str) -> np.dtype:
    """The numpy dtype ``-d`` names, refused unless plait can move it.

    Checked before anything that divides by the element size: ``str``, ``U``, ``S``,
    ``V`` and ``a0`` name dtypes of 0 bytes, which crashed the sizes' arithmetic
    (a ZeroDivisionError) before the reduction's own check refused them, and a
    collective that reduces nothing never asked at all (its ranks failed in every
    call). The barrier moves no data and reads no dtype: any name numpy knows passes.

    Raises:
        ValueError: a name numpy does not know, or a dtype plait cannot move.
    """
    from plait import collectives
    from plait.bench.data import resolve_dtype as by_name
    from plait.ops import check_dtype

    dtype = by_name(args.dtype)
    if not collectives.get(collective).synchronizes:
        try:
            check_dtype(dtype)
        except TypeError as exc:
            raise ValueError(f"-d {args.dtype}: {exc}") from None
    return dtype


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


#: The formats ``--plot`` writes where matplotlib is not installed to say (its usual ones).
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps")


def plot_formats() -> tuple[str, ...]:
    """The file extensions matplotlib saves: its own list if installed, else the usual ones."""
    if importlib.util.find_spec("matplotlib") is None:
        return PLOT_FORMATS
    from matplotlib.backend_bases import FigureCanvasBase

    return tuple(sorted(FigureCanvasBase.get_supported_filetypes()))


def check_outputs(args: argparse.Namespace, *more: str) -> None:
    """Refuse output files that could not be written, before the run, not after it.

    ``--json``, ``--csv``, ``--plot`` and the options named in ``more`` (``"trace"``):
    each file's name must not be empty, its folder must exist and be writable, the file
    must not be a folder, and the plot's extension must be a format matplotlib saves
    (none: matplotlib's PNG).

    Raises:
        ValueError: the first file that could not be written, and why.
    """
    for name in ("json", "csv", "plot", *more):
        path = getattr(args, name, None)
        if path is None:
            continue
        if not path:  # was taken for no file: the run wrote nothing and said nothing of it
            raise ValueError(f"--{name} '' is empty; expected a file name")
        target = Path(path)
        folder = target.parent
        if target.is_dir():
            raise ValueError(f"--{name} {path} is a folder; expected a file name")
        if not folder.is_dir():
            state = "is not a folder" if folder.exists() else "does not exist"
            raise ValueError(f"--{name} {path}: {folder} {state}; expected an existing folder")
        if not os.access(folder, os.W_OK | os.X_OK) or (
            target.exists() and not os.access(target, os.W_OK)
        ):
            raise ValueError(f"--{name} {path}: not writable; expected a file this user can write")
        try:  # what the modes allow, a folder may still refuse (/proc, a read-only mount)
            if target.exists():
                with open(target, "a"):
                    pass
            else:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                os.unlink(target)
        except OSError as exc:
            raise ValueError(
                f"--{name} {path}: cannot be written ({exc.strerror or exc}); expected a file "
                "this user can write"
            ) from None
    plot = getattr(args, "plot", None)
    suffix = Path(plot).suffix.lower().lstrip(".") if plot else ""
    if suffix:
        formats = plot_formats()
        if suffix not in formats:
            raise ValueError(
                f"--plot {plot}: matplotlib cannot save .{suffix} files; expected a name "
                f"ending in .{', .'.join(formats)}"
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
