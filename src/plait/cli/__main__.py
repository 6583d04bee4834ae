"""``plait <subcommand>``: a registry of subcommands, each in its own module.

A subcommand module provides ``add_arguments(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["SUBCOMMANDS", "main"]

#: name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("plait.cli.run", "start N ranks of a Python script or module"),
    "algorithms": ("plait.cli.algorithms", "list the algorithms of each collective"),
    "sim": ("plait.cli.sim", "predict a collective's time on a modelled network"),
    "tune": ("plait.cli.tune", "measure this machine's α, β, γ for algorithm='auto'"),
    "bench": ("plait.cli.bench", "time a collective over a range of sizes; compare with MPI, gloo"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` console script and ``python -m plait``."""
    parser = argparse.ArgumentParser(
        prog="plait", description="plait: collective communication for Python."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the examples' lines
            # No prefixes of long options: `plait run -n 2 train.py --n 3` must hand `--n`
            # to the script, not complain that it could abbreviate --nproc or --nnodes.
            allow_abbrev=False,
        )
        module.add_arguments(p)
        p.set_defaults(_module=module)
    args = parser.parse_args(argv)
    return int(args._module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
