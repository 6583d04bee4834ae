"""Where flight-recorder dumps go: the job they are filed under, and the folder.

``<folder>/<job>/rank<r>.json`` (:meth:`plait.diagnostics.recorder.FlightRecorder.path`);
``plait run`` names the same folder to its users (:mod:`plait.launch.stall`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import stat
import tempfile
import zlib
from pathlib import Path
from typing import Any

__all__ = [
    "COMM_ID_BITS",
    "dump_dir",
    "dump_name",
    "dumped_as",
    "global_rank",
    "job_id",
    "make_folder",
    "read_json",
    "replace_with",
    "safe_name",
    "shrunk_comm_id",
]

#: A number for each file written beside its place: two writes of one file at once on one
#: thread (a dump on SIGUSR1 interrupting an error's dump) each get their own.
_WRITES = itertools.count()


#: Bits of a communicator's id (its place in every wire tag, and the name of its dumps).
COMM_ID_BITS = 18


def shrunk_comm_id(parent_id: int, agreement: int) -> int:
    """Id of the communicator shrunk from ``parent_id`` through its agreement number
    ``agreement`` (never 0): its flight recorder's dumps, and the ids of its splits, are
    not those of the communicator it replaces; ``plait analyze`` follows the same chain."""
    digest = zlib.crc32(f"{parent_id}/shrink/{agreement}".encode())
    return digest % ((1 << COMM_ID_BITS) - 1) + 1


def global_rank() -> int | None:
    """This process's rank in the job, as its launcher says; None if none says."""
    for name in ("PLAIT_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        text = os.environ.get(name)
        if text is not None and (text.strip().isascii() and text.strip().isdigit()):
            return int(text)
    return None


def safe_name(name: str) -> str:
    """``name`` as one path component: never ``.`` or ``..``, which name the folder itself
    or its parent (a PLAIT_JOB_ID of ``..`` filed dumps beside the dump folder)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "job"
    return safe.replace(".", "_") if safe in (".", "..") else safe


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
    never sees half of it; the folder is made if need be (Note [dumps in a shared folder]).

    The file beside is this write's own: with one name per process and thread, a dump
    that a signal handler wrote while the same thread was writing one renamed it away
    first, and the interrupted dump failed ("No such file").

    Raises:
        OSError: the folder cannot be made, written, or trusted (another user's, or
            writable by others without the sticky bit).
    """
    folder = _trusted_folder(target.parent)
    try:
        tmp = f".{target.name}.{os.getpid()}.{next(_WRITES)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target.name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(folder)


# Note [dumps in a shared folder]
#     Dumps go to ``plait-dumps/<job>`` in the temporary folder, which every user of the
#     machine shares, under a job id that is often predictable (``<host>-<port>``, a
#     Slurm id). Another user who made the job's folder first, writable by all, and
#     planted symbolic links under the names of the files a dump writes beside its
#     place, had a job run by root write its dumps over any file the links named. So a
#     dump's file is made new (O_EXCL, never following a link) and private (0600),
#     renamed into place by the descriptor of its folder, and the folder is used only
#     if it and the folder it is in are this user's or root's and not writable by
#     everyone (or sticky, as /tmp is: then only an entry's owner may rename it), and a
#     link to it is this user's or root's: else the dump fails, naming the folder and
#     what to do. A group's shared folder (writable by the group) is trusted. A job
#     folder plait makes is private (0700); the shared ``plait-dumps`` itself is made
#     sticky and writable by all, as /tmp, so that every user's jobs can make their
#     folders in it and none can touch another's.


def read_json(
    path: str, kind: str, error: type[Exception], *, tail: str = "", cut: str = ""
) -> Any:
    """The JSON document in file ``path``; each way it can fail is one line naming the file.

    Raises:
        OSError: it cannot be read (and why, not Python's ``[Errno 2] ...: 'path'``).
        error: it is not ``kind`` (``"a dump"``): not UTF-8, not JSON (and then ``cut``,
            a guess at why), nested too deep for the parser. ``tail`` ends every message.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: not {kind} (not UTF-8 text){tail}") from None
    except OSError as exc:
        raise OSError(f"{path}: cannot be read ({exc.strerror or exc}){tail}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not JSON ({exc}){cut}{tail}") from None
    except RecursionError:  # nested deeper than the parser goes: no such file is
        raise error(f"{path}: not {kind} (JSON nested too deep){tail}") from None


def make_folder(folder: Path) -> None:
    """Make ``folder`` where it is missing: private (0700), and the shared ``plait-dumps``
    of the temporary folder on the way sticky and writable by all, as /tmp (Note [dumps
    in a shared folder]).

    Raises:
        OSError: it cannot be made.
    """
    if folder == Path() or folder.exists():
        return
    shared = Path(tempfile.gettempdir()) / "plait-dumps"
    if folder.parent == shared and not shared.exists():
        with contextlib.suppress(FileExistsError):
            os.mkdir(shared, 0o1777)
            os.chmod(shared, 0o1777)  # the umask left out some of it
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)


def _trusted_folder(folder: Path) -> int:
    """``folder`` (made if missing) opened as a directory, if it can be trusted with a
    dump (Note [dumps in a shared folder]); its descriptor, for the caller to close."""
    make_folder(folder)
    # The folder's own folder too: where others may rename what is in it, they could put a
    # link in place of the folder between the look at it below and its opening.
    _trust(folder.parent, os.stat(folder.parent), folder)
    link = os.lstat(folder)
    if stat.S_ISLNK(link.st_mode):
        _trust(folder, link, folder)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _trust(folder, os.fstat(fd), folder)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _trust(path: Path, st: os.stat_result, folder: Path) -> None:
    """Raise PermissionError unless ``path`` (``st``) is this user's or root's, and not
    writable by everyone without the sticky bit (a group's shared folder is trusted)."""
    foreign = st.st_uid not in (os.getuid(), 0)
    if foreign or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX):
        why = f"belongs to uid {st.st_uid}" if foreign else "is writable by everyone"
        where = "" if path == folder else f" (the folder {folder} is in)"
        raise PermissionError(
            f"{path}{where} {why}: plait writes no dump or trace there, where another user "
            "could replace it or redirect the write; remove it, or set PLAIT_DUMP_DIR (or "
            "the file's path) to a folder of your own"
        )
