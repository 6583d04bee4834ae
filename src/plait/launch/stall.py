"""A rank reports a stall: SIGUSR1 to the job's other ranks, so that every one of them dumps.

With ``plait run --stall-timeout S`` every rank runs a watchdog
(:class:`plait.diagnostics.triggers.Watchdog`) that, when one of the rank's calls has made
no progress for S seconds, dumps that rank's flight recorders and prints a line starting
with :data:`~plait.diagnostics.triggers.STALL_MARKER` on its stderr. The relay
(:mod:`plait.launch.relay`) hands every such line to a :class:`StallResponder`, which sends
SIGUSR1 to the ranks of this host that have not reported the stall themselves, so that they
dump too: a rank stuck outside any collective (in a data loader, in a deadlock of its own)
has no call in flight and would never report, yet its dump is the one that says where it is.
The responder then names the folder that holds the dumps and the ``plait analyze`` command
to read them. The job goes on: a stall is not a failure (the collectives' own timeout still
ends a hang).

Note [one signal per stall]
    One hang makes several ranks report: every rank waiting in the collective has a call
    in flight, and each rank's watchdog reports each call once, a watchdog interval (at
    most 5 s) or so after the others. The first report of an episode sends one round of
    SIGUSR1; reports within the next stall timeout belong to the same episode and send
    nothing (a rank that reports after the round has dumped twice, the later dump being
    its watchdog's, which is as good). A report after that starts a new episode: the
    ranks are stuck elsewhere, and the dumps of the first episode would otherwise be
    stale next to the new one. So a hang costs each rank at most one signal per stall
    timeout. Without a known stall timeout (a command that sets PLAIT_STALL_TIMEOUT
    itself, or a rank that is not plait's), one round per attempt.

Note [who gets SIGUSR1]
    A process that has no handler for SIGUSR1 is killed by it, so a rank is signalled only
    if :func:`~plait.diagnostics.triggers.catches_signal` says that it catches SIGUSR1 (a
    rank that never called :func:`plait.init`, a command that is not Python, or a system
    where this cannot be read, is left alone). A rank that reported the stall in this
    episode has dumped already, with the stall as its reason, and is not signalled: its
    dump would be replaced by one that only says "signal SIGUSR1". Ranks that have exited,
    or that the launcher is stopping, are not signalled either.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# The recorder's own rule for the job's folder name, so that the launcher names the folder
# the ranks write to, whatever PLAIT_JOB_ID holds.
from plait.diagnostics.places import dump_dir, dumped_as, make_folder, safe_name
from plait.diagnostics.schema import LAUNCHER_NOTE, write_launcher_note
from plait.diagnostics.triggers import catches_signal
from plait.launch.watch import RankProcess

__all__ = ["StallResponder", "dump_folder", "folder_problem", "send_usr1", "stall_timeout"]


#: The most seconds a failed job's launcher waits for its other ranks' dumps before it
#: stops them (:meth:`StallResponder.dump_before_stop`).
DUMP_SECONDS = 2.0


def dump_folder(env: Mapping[str, str]) -> Path:
    """The folder where ranks started with ``env`` put their flight-recorder dumps.

    What :meth:`plait.diagnostics.recorder.FlightRecorder.path` makes of it: the rank's
    PLAIT_DUMP_DIR, else the default dump folder, then the job id the launcher gave the
    ranks (PLAIT_JOB_ID, with its ``-rN`` suffix after a restart). The default folder is
    the one of the launcher's temporary folder, which its ranks inherit.
    """
    folder = env.get("PLAIT_DUMP_DIR", "").strip()
    base = Path(folder) if folder else dump_dir()
    return base / safe_name(env.get("PLAIT_JOB_ID", "").strip() or "local")


def folder_problem(folder: Path, *, make: bool = False) -> str | None:
    """Why dumps cannot go to ``folder``, or None.

    The nearest part of the path that exists must be a folder: a ``PLAIT_DUMP_DIR`` that
    names a file, or lies under one, makes every rank's dump fail, and a line that sent
    users to the folder would send them nowhere. ``make``: make the folder now (the
    launcher, as it starts), and say why that fails (``/proc/dumps``, no permission);
    else the folder must exist already (a stall's line: the rank that reports a stall has
    dumped, or failed to, before it says so).
    """
    part = folder
    try:
        while not part.exists() and part != part.parent:
            part = part.parent
        if not part.is_dir():
            return f"{part} is not a folder"
    except OSError as exc:  # a folder on the way that may not be entered
        return f"{folder} cannot be reached ({exc.strerror or exc})"
    if make:
        try:
            make_folder(folder)
        except OSError as exc:
            return f"{folder} cannot be made ({exc.strerror or exc})"
    else:
        try:
            made = folder.is_dir()
        except OSError:
            made = False
        if not made:
            return f"the ranks could not make {folder} (see their 'dump failed' lines)"
    return None


def stall_timeout(env: Mapping[str, str]) -> float | None:
    """PLAIT_STALL_TIMEOUT of ``env`` in seconds; None when unset, 0 or not a number.

    The launcher only needs it to tell stall episodes apart (Note [one signal per stall]);
    a rank that cannot read it says so itself when it starts.
    """
    try:
        seconds = float(env.get("PLAIT_STALL_TIMEOUT", "").strip())
    except ValueError:
        return None
    return seconds if seconds > 0 else None


class StallResponder:
    """Sends SIGUSR1 to the other ranks of this host when one reports a stall (see above).

    Args:
        ranks: this attempt's ranks, in rank order (the list the launcher fills as it
            starts them; read only when a stall is reported).
        folder: where the ranks' dumps go (:func:`dump_folder`).
        window: seconds after a round of signals during which further reports belong to
            the same episode (Note [one signal per stall]); None: the whole attempt.
        catches: whether a pid has a SIGUSR1 handler (None: cannot tell).
        clock: a monotonic clock, in seconds.

    :meth:`report` is called by the relay's one thread only, so the responder holds no lock.
    """

    def __init__(
        self,
        ranks: Sequence[RankProcess],
        folder: Path,
        window: float | None,
        *,
        catches: Callable[[int], bool | None] = catches_signal,
        clock: Callable[[], float] = time.monotonic,
        note: str = LAUNCHER_NOTE,
    ) -> None:
        self._ranks = ranks
        self._note = note  # the name of this launcher's note (one per host)
        self.folder = folder
        self._window = window
        self._catches = catches
        self._clock = clock
        self._episode: float | None = None  # clock() at the latest round of signals
        self._reported: set[int] = set()  # ranks that reported in the current episode

    def report(self, rank: int, description: str) -> str | None:
        """Rank ``rank`` printed a stall line (``description``: what follows the marker).

        Returns the line for the launcher to print when this report starts an episode (it
        says which ranks were signalled and where the dumps are), else None.
        """
        now = self._clock()
        if self._episode is not None and (
            self._window is None or now - self._episode < self._window
        ):
            self._reported.add(rank)
            return None
        self._episode = now
        self._reported = {rank}
        signalled, left = [], []
        for r in self._ranks:
            if r.rank in self._reported or r.exit is not None or r.stopped:
                continue
            if r.proc.returncode is not None:
                continue  # exited, and reaped: its pid may be another process's by now
            if not self._catches(r.proc.pid):
                left.append(r.rank)
            elif send_usr1(r.proc):
                signalled.append(r.rank)
        problem = folder_problem(self.folder)
        folder = shlex.quote(str(self.folder))
        what = (
            f"SIGUSR1 sent to have {_ranks(signalled)} dump too"
            if signalled
            else "no other rank signalled"
        )
        if left:
            what += f" (not {_ranks(left)}: no handler for SIGUSR1)"
        if problem is not None:
            return f"rank {rank} reports a stall; {what}; no dumps: {problem}"
        return f"rank {rank} reports a stall; {what}; dumps in {folder}: plait analyze {folder}"

    def dump_before_stop(
        self, ended: Mapping[int, str], since: float | None = None, seconds: float = DUMP_SECONDS
    ) -> str | None:
        """Before the launcher stops a failed job's ranks still running (with none left:
        the note alone): note how the failed ranks ``ended`` (rank: "was killed by
        SIGKILL") beside the dumps, for ``plait analyze``; have the ranks that catch
        SIGUSR1 dump, and wait up to ``seconds`` until each one has a dump newer than
        ``since`` (the failure, wall-clock; default now: a rank that dumped the error it
        met keeps that dump): of its world communicator (``rank<r>.json``) or of any other
        it has (a communicator shrunk after a loss: ``comm<id>.rank<i>.json``, its rank in
        the job in the file). The line that says so, or None where no rank was signalled.

        A rank killed by SIGKILL left no dump, and the others, stopped at once, none
        either: ``plait analyze`` had nothing to read. They dump on their own only where
        they meet the loss in a call before the launcher's SIGTERM.
        """
        start = time.time() if since is None else since
        with contextlib.suppress(OSError):  # no note: analyze says less, nothing worse
            write_launcher_note(self.folder, ended, self._note)
        signalled = [
            r
            for r in self._ranks
            if r.exit is None
            and not r.stopped
            and r.proc.returncode is None
            and self._catches(r.proc.pid)
            and send_usr1(r.proc)
        ]
        if not signalled:
            return None
        deadline = self._clock() + seconds
        asked = {r.rank for r in signalled}
        ranks: dict[tuple[str, int], int | None] = {}  # each file's rank in the job, once read
        while not asked <= _dumped(self.folder, start, ranks) and self._clock() < deadline:
            time.sleep(0.05)  # files: nothing to wait on but them
        folder = shlex.quote(str(self.folder))
        done = sorted(asked & _dumped(self.folder, start, ranks))
        if not done:
            return f"asked {_ranks([r.rank for r in signalled])} to dump; none did in {seconds:g} s"
        return f"{_ranks(done)} dumped their calls before being stopped: plait analyze {folder}"


def _dumped(folder: Path, since: float, ranks: dict[tuple[str, int], int | None]) -> set[int]:
    """The ranks of the job with a dump in ``folder`` written at ``since`` or later: a
    world communicator's by its name (``rank<r>.json``), another's by the rank in the job
    its file records (``ranks``: what each file, by name and time, was found to hold)."""
    found: set[int] = set()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return found
    for entry in entries:
        named = dumped_as(entry.name)
        try:
            stat = entry.stat()
        except OSError:  # gone meanwhile
            continue
        if named is None or stat.st_mtime < since:
            continue
        written = stat.st_mtime_ns
        if named[0] == 0:
            found.add(named[1])
            continue
        if (entry.name, written) not in ranks:
            ranks[entry.name, written] = _job_rank(Path(entry.path))
        rank = ranks[entry.name, written]
        if rank is not None:
            found.add(rank)
    return found


def _job_rank(path: Path) -> int | None:
    """The rank in the job (``global_rank``) of the process whose dump ``path`` is, or None."""
    try:
        rank = json.loads(path.read_text(encoding="utf-8")).get("global_rank")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return rank if type(rank) is int else None


def send_usr1(proc: subprocess.Popen[bytes]) -> bool:
    """Send SIGUSR1 to ``proc`` unless it has exited (and may have been reaped); whether sent."""
    try:
        proc.send_signal(signal.SIGUSR1)  # does nothing for a process already reaped
    except ProcessLookupError:
        return False
    return proc.returncode is None


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 0, 1, 3``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
