"""Start each system's ranks for one sweep and read their rows back.

- plait and gloo ranks are started by ``plait run``'s own launcher
  (:func:`plait.launch.launch`), which watches over them and cleans up;
- Open MPI's ranks by ``mpirun`` (``--mca btl self,vader`` for shared memory,
  ``self,tcp`` restricted to the loopback interface for TCP; ``--mca pml ob1``
  so that these transports are the ones used).

Workers write their rows to a JSON file of a private temp directory, and
each row as it is measured to a progress file that the bench follows
(:class:`plait.bench.progress.Follower`); their stdout is sent to the bench's
stderr, so the bench's stdout holds nothing but the table.

When the ranks stop because the bench was interrupted (Ctrl-C: the launcher
exits 130, SIGTERM: 143), the runners raise :class:`Interrupted` with the
series measured until then, taken from the progress file, so that nothing
measured is lost.

Ranks that fail before they report anything leave their cause in the lines the
launcher says on stderr (``rank 0 failed with StoreTimeout: …``); the series'
error repeats it, since the table's ``# error`` line is all that ``--no-progress``
and a saved JSON file keep. A launcher that cannot start the ranks (too few file
descriptors, a limit of the host) fails its series with that one line, as
``plait run`` says it, not a traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field, replace
from typing import IO, Any, cast

from plait.bench.loop import SweepSpec
from plait.bench.progress import Follower, Live
from plait.errors import RendezvousError
from plait.launch import TRANSPORTS, Job, StartError, launch, module_command

__all__ = [
    "INTERRUPT_CODES",
    "Interrupted",
    "RunOptions",
    "Series",
    "gloo_missing",
    "mpi_missing",
    "open_mpi_version",
    "run_gloo",
    "run_mpi",
    "run_plait",
    "transports",
]

#: What to install for each compared system, for the skip messages.
INSTALL = {
    "mpi": "apt-get install -y openmpi-bin libopenmpi-dev && pip install mpi4py",
    "gloo": "pip install torch==2.13.0, a CPU build: --index-url https://download.pytorch.org/whl/cpu",
}


@dataclass
class Series:
    """One line of results: a system, a transport and a requested algorithm, row by row."""

    system: str  # plait, mpi or gloo
    label: str
    transport: str  # shm, tcp or auto
    requested: str  # the algorithm asked for (auto, ring, …); the rows say which ran
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


#: Exit codes of ``plait run``'s launcher stopped by SIGINT (Ctrl-C) or SIGTERM.
INTERRUPT_CODES = {130: "SIGINT", 143: "SIGTERM"}


class Interrupted(Exception):
    """The bench was interrupted while a system's ranks ran.

    ``series``: that system's series with the rows measured until then;
    ``code``: the exit code the bench should end with (130 for Ctrl-C).
    """

    def __init__(self, series: list[Series], code: int = 130) -> None:
        super().__init__(f"interrupted ({INTERRUPT_CODES.get(code, code)})")
        self.series = series
        self.code = code


@dataclass(frozen=True)
class RunOptions:
    """How to start every system's ranks, and where their rows go as they are measured."""

    nproc: int
    timeout: float  # seconds per call before a rank gives up (not plait.init's: its own)
    tmpdir: str
    live: Live | None = None  # None: rows are kept, nothing is printed


def _live(opts: RunOptions) -> Live:
    return opts.live if opts.live is not None else Live(rows=False, bar=False)


def transports() -> tuple[str, ...]:
    """The transports ``plait run --transport`` accepts (``auto`` first)."""
    return TRANSPORTS


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
            return data
    except (OSError, ValueError):
        return None


def _paths(opts: RunOptions, name: str) -> tuple[str, str, str]:
    base = os.path.join(opts.tmpdir, re.sub(r"[^\w.-]", "_", name))
    for p in (base + ".results.json", base + ".progress"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    return base + ".spec.json", base + ".results.json", base + ".progress"


class _Said:
    """The bench's stderr as the launcher's stream: every line goes on, its own are kept.

    The launcher writes its lines (``plait run: rank 0 failed with …``) and the ranks'
    stderr here, whole lines at a time, one writer at a time (its relay holds a lock);
    :meth:`cause` gives the line that names why the ranks failed.
    """

    def __init__(self, out: IO[str], label: str) -> None:
        self._out = out
        self._prefix = f"{label}: "
        self._partial = ""
        self.lines: list[str] = []  # the launcher's own, without its label

    def write(self, text: str) -> int:
        """Pass ``text`` on; keep each whole line of the launcher's own."""
        self._out.write(text)
        *whole, self._partial = (self._partial + text).split("\n")
        self.lines += [ln[len(self._prefix) :] for ln in whole if ln.startswith(self._prefix)]
        return len(text)

    def flush(self) -> None:
        """Flush the bench's stderr."""
        self._out.flush()

    def cause(self) -> str | None:
        """Why the ranks failed, as the launcher said it: the rank that failed and its
        exception's last line where one was read, else the first line about a rank."""
        about = [ln for ln in self.lines if ln.startswith("rank ")]
        failed = [ln for ln in about if " failed with " in ln]
        return failed[-1] if failed else about[0] if about else None


def _launch(
    module: str,
    spec: SweepSpec,
    spec_path: str,
    opts: RunOptions,
    transport: str | None,
    env: dict[str, str],
) -> tuple[int, dict[str, Any] | None, float, Live, str | None]:
    """Run ``module`` on ``opts.nproc`` ranks with ``plait run``'s launcher.

    The ranks' stdout goes to the bench's stderr, so that its stdout holds only the table.
    Returns (exit code, results, seconds, the rows as they came, why the ranks failed as
    the launcher said it, else None): the exit code is 130 if the bench got
    KeyboardInterrupt meanwhile. Ranks that could not be started give code 1, as
    ``plait run`` exits then, and results that say why, as the ranks' own error would.
    """
    spec.save(spec_path)
    # No timeout= here: it would set PLAIT_TIMEOUT, which plait.init reads for its own
    # deadline too (Note [the bench's timeout] in plait.bench.worker).
    job = Job(module_command(module, spec_path), nproc=opts.nproc, env=env, transport=transport)
    assert spec.progress is not None
    live = _live(opts)
    said = _Said(sys.stderr, job.label)
    with Follower(spec.label, spec.progress, live) as follower:
        try:
            # 130 when the launcher got SIGINT; it writes to said as to a text stream
            code = launch(job, stdout=sys.stderr, stderr=cast(IO[str], said))
        except KeyboardInterrupt:  # before or after the launcher watched for it
            code = 130
        except (RendezvousError, StartError) as exc:  # a limit of the host: plait run's line
            return 1, {"rows": [], "error": str(exc)}, follower.seconds, live, None
    why = said.cause() if code != 0 else None
    return code, _read(spec.results), follower.seconds, live, why


def _series(
    base: Series,
    code: int,
    result: dict[str, Any] | None,
    seconds: float,
    why: str | None = None,
) -> Series:
    s = replace(base, seconds=seconds)
    if result is None:
        s.error = f"the ranks exited with code {code} and reported nothing"
        if why is not None:
            s.error += f"; {why}"
        return s
    s.rows = result.get("rows", [])
    s.info = result.get("info", {})
    s.skipped = result.get("skipped")
    s.error = result.get("error")
    if s.error is None and code != 0:
        s.error = f"the ranks exited with code {code}"
    return s


def _collect(
    bases: list[Series],
    job: str,
    code: int,
    result: dict[str, Any] | None,
    seconds: float,
    live: Live,
    why: str | None = None,
) -> list[Series]:
    """One series per requested algorithm; raise :class:`Interrupted` if the run was stopped.

    Without a results file (the ranks were stopped, or died) the rows come from
    the progress file, as they were measured, and the error ends with ``why``, the
    launcher's line on why the ranks failed. An algorithm the ranks refused
    (:class:`plait.bench.loop.Refused`) has its reason as its series' error; where
    one algorithm's call failed and stopped the sweep, its series has the error and
    the others say that they stopped with it.
    """
    out = []
    refused = result.get("refused", {}) if result is not None else {}
    failed = result.get("failed") if result is not None else None
    for base in bases:
        s = _series(base, code, result, seconds, why)
        if result is None:
            s.rows = live.series_rows(job, base.requested)
            if s.rows:
                s.error = f"the ranks exited with code {code} after {len(s.rows)} rows"
                if why is not None:
                    s.error += f"; {why}"
        else:
            s.rows = [r for r in s.rows if r.get("requested", "auto") == base.requested]
            if base.requested in refused:  # this algorithm alone could not run here
                s.error = refused[base.requested]
            elif s.error is not None and failed and failed != base.requested:
                # Another algorithm's call failed, and the sweep stopped with it.
                s.error = f"stopped after {len(s.rows)} rows, when {failed} failed"
        out.append(s)
    if code in INTERRUPT_CODES:
        for s in out:
            s.error = f"interrupted ({INTERRUPT_CODES[code]}) after {len(s.rows)} rows"
        raise Interrupted(out, code)
    return out


def run_plait(spec: SweepSpec, transport: str, opts: RunOptions) -> list[Series]:
    """plait's sweep over ``transport``: one series per requested algorithm.

    Raises:
        Interrupted: the bench was interrupted; it carries the rows measured so far.
    """
    label = plait_label(transport)
    spec_path, results, progress = _paths(opts, label)
    spec = replace(spec, results=results, progress=progress, label=label)
    spec = replace(spec, options={**spec.options, "timeout": opts.timeout})
    code, result, seconds, live, why = _launch(
        "plait.bench.worker", spec, spec_path, opts, transport, {}
    )
    bases = [
        Series("plait", label if algo == "auto" else f"{label} {algo}", transport, algo)
        for algo in spec.algorithms
    ]
    return _collect(bases, label, code, result, seconds, live, why)


def plait_label(transport: str) -> str:
    """The label of plait's series over ``transport`` (``plait``, ``plait-shm``, …)."""
    return "plait" if transport == "auto" else f"plait-{transport}"


def gloo_missing() -> str | None:
    """Why gloo cannot be compared here, or None."""
    if importlib.util.find_spec("torch") is None:
        return f"torch is not installed ({INSTALL['gloo']})"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_gloo(spec: SweepSpec, opts: RunOptions) -> Series:
    """The sweep through torch.distributed's gloo backend (TCP on loopback)."""
    base = Series("gloo", "gloo", "tcp", "auto")
    why = gloo_missing()
    if why is not None:
        _live(opts).end("gloo")
        return replace(base, skipped=why)
    spec_path, results, progress = _paths(opts, "gloo")
    options = {"port": _free_port(), "timeout": opts.timeout}
    spec = replace(
        spec, results=results, progress=progress, label="gloo", algorithms=["auto"], options=options
    )
    env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    module = "plait.bench.compare.gloo_worker"
    code, result, seconds, live, why = _launch(module, spec, spec_path, opts, None, env)
    return _collect([base], "gloo", code, result, seconds, live, why)[0]


def open_mpi_version() -> tuple[int, ...] | None:
    """The version of the ``mpirun`` on PATH if it is Open MPI's, else None."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    try:
        res = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Open MPI\)?\s+(\d+)\.(\d+)(?:\.(\d+))?", res.stdout + res.stderr)
    if m is None:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def mpi_missing() -> str | None:
    """Why Open MPI cannot be compared here, or None."""
    if shutil.which("mpirun") is None:
        return f"mpirun is not installed ({INSTALL['mpi']})"
    if open_mpi_version() is None:
        return f"the mpirun on PATH is not Open MPI's ({INSTALL['mpi']})"
    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed ({INSTALL['mpi']})"
    return None


def _mpirun_command(transport: str, nproc: int, spec_path: str) -> list[str]:
    version = open_mpi_version() or (4,)
    shm = "sm" if version[0] >= 5 else "vader"
    cmd = [shutil.which("mpirun") or "mpirun"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    # More ranks than cores need --oversubscribe; ranks are not pinned, like plait's.
    cmd += ["--oversubscribe", "--bind-to", "none", "-np", str(nproc)]
    cmd += [
        "--mca",
        "pml",
        "ob1",
        "--mca",
        "btl",
        f"self,{shm}" if transport == "shm" else "self,tcp",
    ]
    cmd += ["--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]
    return [*cmd, sys.executable, "-u", "-m", "plait.bench.compare.mpi_worker", spec_path]


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_mpi(spec: SweepSpec, transport: str, opts: RunOptions) -> Series:
    """The sweep through mpi4py over Open MPI's ``shm`` or ``tcp`` transport."""
    label = f"mpi-{transport}"
    base = Series("mpi", label, transport, "auto")
    why = mpi_missing()
    if why is not None:
        _live(opts).end(label)
        return replace(base, skipped=why)
    spec_path, results, progress = _paths(opts, label)
    spec = replace(
        spec,
        results=results,
        progress=progress,
        label=label,
        algorithms=["auto"],
        options={"btl": transport},
    )
    spec.save(spec_path)
    env = dict(os.environ)
    if shutil.which("ssh") is None and shutil.which("rsh") is None:
        # Open MPI refuses to start without a remote shell, even on one host.
        env["OMPI_MCA_plm_rsh_agent"] = "false"
        env["PRTE_MCA_plm_ssh_agent"] = "false"
    # No per-call deadline in MPI: bound the whole run instead.
    limit = opts.timeout * (len(spec.points) + 2)
    live = _live(opts)
    with Follower(label, progress, live) as follower:
        proc = subprocess.Popen(
            _mpirun_command(transport, opts.nproc, spec_path),
            env=env,
            stdout=sys.stderr.fileno(),
            start_new_session=True,  # a Ctrl-C reaches the bench only, which stops mpirun
        )
        try:
            code = proc.wait(limit)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            base = replace(base, rows=live.series_rows(label, "auto"))
            return replace(base, error=f"stopped after {limit:.0f} s", seconds=follower.seconds)
        except KeyboardInterrupt:
            _stop_group(proc)
            code = 130
        except BaseException:
            _stop_group(proc)
            raise
    results_doc = _read(results) if code not in INTERRUPT_CODES else None
    return _collect([base], label, code, results_doc, follower.seconds, live)[0]
