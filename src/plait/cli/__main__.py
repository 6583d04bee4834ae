"""``plait <subcommand>``: a registry of subcommands, each in its own module.

A subcommand module provides ``add_arguments(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Sequence

from plait.cli import plain

__all__ = ["SUBCOMMANDS", "main", "version"]

#: name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("plait.cli.run", "start N ranks of a Python script, a module or a command"),
    "algorithms": ("plait.cli.algorithms", "list the algorithms of each collective"),
    "sim": ("plait.cli.sim", "predict a collective's time on a modelled network"),
    "tune": ("plait.cli.tune", "measure this machine's α, β, γ for algorithm='auto'"),
    "bench": ("plait.cli.bench", "time a collective over a range of sizes; compare with MPI, gloo"),
    "analyze": (
        "plait.diagnostics.analyze",
        "say what went wrong first, from the flight-recorder dumps of every rank",
    ),
    "store": ("plait.cli.store", "serve the rendezvous store for PLAIT_STORE=tcp://host:port"),
}


def version() -> str:
    """plait's version: the installed distribution's, else the package's ``__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("plait")
    except PackageNotFoundError:  # run from a source tree that is not installed
        import plait

        return plait.__version__


class _Version(argparse.Action):
    """``--version``: print ``plait <version>`` and exit; looked up only when asked (~15 ms)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="print plait's version and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"plait {version()}")  # on stdout, as argparse's own version action does
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` console script and ``python -m plait``."""
    parser = argparse.ArgumentParser(
        prog="plait", description="plait: collective communication for Python."
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=help_text,
            description=plain(module.__doc__ or ""),
            formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the examples' lines
            # No prefixes of long options: `plait run -n 2 train.py --n 3` must hand `--n`
            # to the script, not complain that it could abbreviate --nproc or --nnodes.
            allow_abbrev=False,
        )
        module.add_arguments(p)
        p.set_defaults(_module=module, _parser=p)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report them with the subcommand's usage, not plait's
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        code = int(args._module.main(args) or 0)
        if sys.stdout is not None:  # None where it was closed (``plait run ... >&-``)
            sys.stdout.flush()  # here, not at exit, where a closed pipe could not be handled
        return code
    except BrokenPipeError:
        # The reader went away (``plait tune --show | head``): stop quietly, as a shell tool
        # does, and keep Python from writing the rest of the buffer to the closed pipe at exit.
        _drop_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    except KeyboardInterrupt:  # Ctrl-C where the subcommand has no answer of its own
        print(f"plait {args.command}: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT
    except OSError as exc:
        if exc.filename is not None or exc.errno not in _WRITE_ERRORS:
            raise
        # stdout could not take the output (a full disk, /dev/full): say so, not a traceback.
        _drop_stdout()
        print(f"plait {args.command}: cannot write the output: {exc.strerror}", file=sys.stderr)
        return 1


#: The errors of a write to a file that is full or broken, which stdout may give.
_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that Python writes no rest of its buffer at exit."""
    if sys.stdout is None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
