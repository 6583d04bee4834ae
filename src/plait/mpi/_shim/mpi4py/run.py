"""``python -m mpi4py``: run a program as mpi4py's ``mpi4py.run`` does, on plait.mpi.

    plait run -n 4 --mpi4py python -m mpi4py script.py [arg] ...
    plait run -n 4 --mpi4py python -m mpi4py -m package.module [arg] ...
    plait run -n 4 --mpi4py python -m mpi4py -c "code" [arg] ...
    plait run -n 4 --mpi4py python -m mpi4py - [arg] ...      # the program on standard input

The program runs as ``__main__`` with the ``sys.argv`` Python would give it (``script.py``,
the module's file, ``-c`` or ``-``, then the arguments). Options before it, as mpi4py's:
``-rc key=value,...`` (sets ``mpi4py.rc``, values read as Python literals), ``--version``,
``--prefix``, ``--mpi-std-version``, ``--mpi-lib-version`` and ``-h``. ``--mpi-library``
(the path of the MPI library) is refused: plait.mpi runs on none.

Note [running under -m mpi4py]
    mpi4py's reason for ``-m mpi4py`` is a rank that fails: it calls ``MPI_Abort`` on the
    way out, so the other ranks do not wait forever in their next call. plait.mpi's
    ``COMM_WORLD`` does that for an uncaught exception in any script, run this way or not
    (its exception hook, Note [the world communicator] in plait.mpi._comm); here a
    ``SystemExit`` with a non-zero status and Ctrl-C abort the world too, as mpi4py's
    ``set_abort_status`` does, and then end the process as they would have. A world that
    never joined the job is not joined to be aborted: its launcher ends the job.
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
import types
from pathlib import Path
from typing import NoReturn

__all__ = ["main", "run_command_line"]

_USAGE = """\
usage: {python} -m mpi4py [options] <pyfile> [arg] ...
   or: {python} -m mpi4py [options] -m <mod> [arg] ...
   or: {python} -m mpi4py [options] -c <cmd> [arg] ...
   or: {python} -m mpi4py [options] - [arg] ..."""

_OPTIONS = """\
options:
  --prefix             show install path and exit
  --version            show version number and exit
  --mpi-std-version    show MPI standard version and exit
  --mpi-lib-version    show MPI library version and exit
  -h|--help            show this help message and exit
  -rc <key=value,...>  set 'mpi4py.rc.key=value'
(this mpi4py is plait.mpi's: `python -m plait run --mpi4py` put it on the path)"""


def _usage(error: str | None = None) -> NoReturn:
    """Print the usage (to stderr, with ``error``, and exit 1; else to stdout, exit 0)."""
    text = _USAGE.format(python=Path(sys.executable).name)
    if error is None:
        print(text, _OPTIONS, sep="\n")
        sys.exit(0)
    print(error, text, "Try `python -m mpi4py -h` for more information.", sep="\n", file=sys.stderr)
    sys.exit(1)


def _show(line: str) -> NoReturn:
    print(line)
    sys.exit(0)


def _rc_settings(text: str) -> dict[str, object]:
    """``key=value,...`` as mpi4py's ``-rc`` reads it: each value a Python literal if it is
    one (``False``, ``4``), else the word itself (``multiple``)."""
    settings: dict[str, object] = {}
    for entry in text.split(","):
        key, _, value = entry.partition("=")
        if not key or not value:
            _usage(f"Cannot parse rc option: {entry}")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return settings


def _options(args: list[str]) -> tuple[dict[str, object], list[str]]:
    """The ``-rc`` settings and the program's words (``script.py ...``, ``-m mod ...``, ...);
    the options that only show something show it and exit."""
    from plait import mpi as MPI

    from . import __version__

    rc: dict[str, object] = {}
    args = list(args)
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c", "-"):
        word = args.pop(0)
        option, _, value = word.lstrip("-").partition("=")
        if option in ("h", "help"):
            _usage()
        elif option == "prefix":
            _show(str(Path(__file__).resolve().parent))
        elif option == "version":
            _show(f"mpi4py {__version__}")
        elif option == "mpi-std-version":
            _show("MPI {}.{}".format(*MPI.Get_version()))
        elif option == "mpi-lib-version":
            _show(MPI.Get_library_version())
        elif option == "mpi-library":
            _usage("Unsupported option: --mpi-library (plait.mpi runs on no MPI library)")
        elif option == "rc":
            if not value:
                if not args or args[0].startswith("-"):
                    _usage("Argument expected for option: -rc")
                value = args.pop(0)
            rc.update(_rc_settings(value))
        else:
            _usage(f"Unknown option: {word}")
    if not args:
        _usage("No path specified for execution")
    if args[0] in ("-m", "-c") and len(args) < 2:
        _usage(f"Argument expected for option: {args[0]}")
    return rc, args


def _run_code(code: str, filename: str, argv0: str, args: list[str]) -> None:
    """Run ``code`` as the ``__main__`` module, as ``python -c`` does: a fresh module in
    ``sys.modules``, so that what it defines pickles by its name there."""
    sys.argv[:] = [argv0, *args]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(code, filename, "exec", dont_inherit=True), main.__dict__)  # not our __future__


def run_command_line(args: list[str] | None = None) -> None:
    """Run ``[pyfile | -m mod | -c cmd | -] [arg] ...`` (``sys.argv[1:]`` by default) as
    ``__main__``."""
    args = list(sys.argv[1:] if args is None else args)
    if args[0] == "-":
        _run_code(sys.stdin.read(), "<stdin>", "-", args[1:])
    elif args[0] == "-c":
        _run_code(args[1], "<string>", "-c", args[2:])
    elif args[0] == "-m":
        sys.argv[:] = args[1:]  # runpy puts the module's file in argv[0]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv[:] = args
        if not sys.flags.isolated:  # the script's folder first on the path, as python's
            sys.path[0] = os.path.realpath(os.path.dirname(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def _abort_world(status: int) -> None:
    """Abort the world, if it joined the job, for a program that ends with ``status``
    (Note [running under -m mpi4py])."""
    from plait import mpi as MPI

    comm = MPI.COMM_WORLD._comm
    if status and comm is not None and not comm.closed:
        comm.abort(f"rank {comm.rank} exited with status {status}")


def main(args: list[str] | None = None) -> None:
    """``python -m mpi4py [options] <program> [arg] ...``: the options, then the program."""
    rc, program = _options(sys.argv[1:] if args is None else args)
    if rc:
        from . import rc as settings

        settings(**rc)
    try:
        run_command_line(program)
    except SystemExit as exc:
        code = exc.code
        _abort_world(code if isinstance(code, int) else 0 if code is None else 1)
        raise
    except KeyboardInterrupt:
        import signal

        _abort_world(128 + signal.SIGINT)
        raise


if __name__ == "__main__":
    main()
