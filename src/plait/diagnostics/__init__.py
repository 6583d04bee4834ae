"""Diagnosing hangs and slow ranks: the flight recorder, its dumps, their analysis, timelines.

- :mod:`~plait.diagnostics.recorder`: :class:`FlightRecorder`, a ring of each
  communicator's last calls, always on, dumped as JSON;
- :mod:`~plait.diagnostics.schema`: the dump format, and reading dumps back;
- :mod:`~plait.diagnostics.triggers`: dumps on a communication error, on
  SIGUSR1 and on a stall (:class:`Watchdog`);
- :mod:`~plait.diagnostics.analyze`: ``plait analyze``, what went wrong first,
  in plain words, from the dumps of all ranks;
- :mod:`~plait.diagnostics.stragglers`: how late each rank arrives at the
  collectives;
- :mod:`~plait.diagnostics.timeline`: ``PLAIT_TIMELINE``, a Chrome / Perfetto
  trace of a real run.

:mod:`~plait.diagnostics.analyze` and :mod:`~plait.diagnostics.timeline` are
not imported here, nor by ``import plait``: they are also scripts
(``python -m``), which Python warns about if the module was imported before it
runs. Only the tools that read dumps import ``analyze``; the call runner
imports ``timeline`` when it makes a communicator.

This package sits at the bottom of plait's layers: it imports only
:mod:`plait.errors`, numpy and the standard library, so the executor, the
call runner and the launcher can all use it. How to use it: docs/debugging.md.
"""

from __future__ import annotations

from plait.diagnostics.places import dump_dir as dump_dir
from plait.diagnostics.recorder import CallShape as CallShape
from plait.diagnostics.recorder import FlightRecorder as FlightRecorder
from plait.diagnostics.recorder import Slot as Slot
from plait.diagnostics.schema import CallRecord as CallRecord
from plait.diagnostics.schema import Dump as Dump
from plait.diagnostics.schema import DumpError as DumpError
from plait.diagnostics.schema import load as load
from plait.diagnostics.stragglers import Lateness as Lateness
from plait.diagnostics.triggers import Watchdog as Watchdog
from plait.diagnostics.triggers import dump_all as dump_all
from plait.diagnostics.triggers import dump_on_error as dump_on_error
from plait.diagnostics.triggers import install_signal_handler as install_signal_handler

__all__ = [
    "CallRecord",
    "CallShape",
    "Dump",
    "DumpError",
    "FlightRecorder",
    "Lateness",
    "Slot",
    "Watchdog",
    "dump_all",
    "dump_dir",
    "dump_on_error",
    "install_signal_handler",
    "load",
]
