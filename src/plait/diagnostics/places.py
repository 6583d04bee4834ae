"""Where flight-recorder dumps go: the job they are filed under, and the folder.

``<folder>/<job>/rank<r>.json`` (:meth:`plait.diagnostics.recorder.FlightRecorder.path`);
``plait run`` names the same folder to its users (:mod:`plait.launch.stall`).
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile
from pathlib import Path

__all__ = [
    "dump_dir",
    "dump_name",
    "dumped_as",
    "global_rank",
    "job_id",
    "replace_with",
    "safe_name",
]

#: A number for each file written beside its place: two writes of one file at once on one
#: thread (a dump on SIGUSR1 interrupting an error's dump) each get their own.
_WRITES = itertools.count()


def global_rank() -> int | None:
    """This process's rank in the job, as its launcher says; None if none says."""
    for name in ("PLAIT_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        text = os.environ.get(name)
        if text is not None and text.strip().isdigit():
            return int(text)
    return None


def safe_name(name: str) -> str:
    """``name`` as one path component."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "job"


def job_id() -> str:
    """The id dumps are filed under: the launcher's job id, else ``local``.

    PLAIT_JOB_ID (set by ``plait run``), then torchrun's TORCHELASTIC_RUN_ID,
    then Slurm's SLURM_JOB_ID.
    """
    for name in ("PLAIT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        text = os.environ.get(name, "").strip()
        if text:
            return text
    return "local"


def dump_dir() -> Path:
    """The dump folder: PLAIT_DUMP_DIR, else ``plait-dumps`` in the temporary folder."""
    text = os.environ.get("PLAIT_DUMP_DIR", "").strip()
    return Path(text) if text else Path(tempfile.gettempdir()) / "plait-dumps"


def dump_name(comm: int, rank: int) -> str:
    """The file a dump of communicator ``comm``'s rank ``rank`` goes to in its job's folder:
    ``rank<r>.json`` for the world, ``comm<id in hex>.rank<r>.json`` for a split."""
    return f"rank{rank}.json" if comm == 0 else f"comm{comm:x}.rank{rank}.json"


def dumped_as(name: str) -> tuple[int, int] | None:
    """(communicator, rank) of a file named by :func:`dump_name`, or None."""
    m = _NAME.fullmatch(name)
    return None if m is None else (int(m.group(1) or "0", 16), int(m.group(2)))


_NAME = re.compile(r"(?:comm([0-9a-f]+)\.)?rank(\d+)\.json")


def replace_with(target: Path, text: str) -> None:
    """Write ``text`` beside ``target`` and rename it over ``target``, so that a reader
    never sees half of it. The file beside is this write's own: with one name per process
    and thread, a dump that a signal handler wrote while the same thread was writing one
    renamed it away first, and the interrupted dump failed ("No such file")."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{next(_WRITES)}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)
