"""Dumps and traces in folders other users share (Note [dumps in a shared folder] in
plait.diagnostics.places): nothing another user planted redirects a write, and a folder
they could tamper with is refused, naming it.

The probe: another user made a job's dump folder first (``<host>-<port>`` is predictable),
writable by all, and planted links under the names a dump writes beside its place; a job
run by root then wrote its dump over the file the links named.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from plait.diagnostics import places
from plait.diagnostics.places import make_folder, replace_with
from plait.diagnostics.recorder import FlightRecorder

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


def plant(folder: Path, name: str, target: Path, count: int = 50) -> None:
    """Links under the names the next ``count`` writes of ``name`` use beside it."""
    first = next(places._WRITES) + 1
    for n in range(first, first + count):
        (folder / f".{name}.{os.getpid()}.{n}.tmp").symlink_to(target)


def test_a_folder_writable_by_everyone_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    precious = victim(tmp_path)
    job = tmp_path / "dumps" / "127.0.0.1-29500"
    job.mkdir(parents=True)
    job.chmod(0o777)  # not sticky: anyone may rename what is in it
    plant(job, "rank0.json", precious)
    rec = FlightRecorder(0, 2, job="127.0.0.1-29500", folder=tmp_path / "dumps")
    with pytest.raises(PermissionError, match=r"127\.0\.0\.1-29500 is writable by everyone"):
        rec.dump("MismatchError: test")
    assert precious.read_text() == "precious"
    assert not (job / "rank0.json").exists()


@pytest.mark.skipif(not ROOT, reason="making a folder another user's needs root")
def test_a_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    job = tmp_path / "theirs"
    job.mkdir(mode=0o755)
    os.chown(job, 54321, 54321)
    with pytest.raises(PermissionError, match="belongs to uid 54321"):
        replace_with(job / "rank0.json", "{}")
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    os.lchown(link, 54321, 54321)
    with pytest.raises(PermissionError, match="link belongs to uid 54321"):
        replace_with(link / "rank0.json", "{}")


def test_links_in_a_sticky_folder_redirect_no_write(tmp_path: Path) -> None:
    # PLAIT_TIMELINE=/tmp/trace.json: /tmp is everyone's, but sticky, so trusted; a link
    # planted at a name written beside the file fails the write, and one planted at the
    # file itself is replaced, never followed.
    precious = victim(tmp_path)
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    target = shared / "trace.json"
    target.symlink_to(precious)
    replace_with(target, '{"ok": 1}')
    assert precious.read_text() == "precious"
    assert not target.is_symlink()
    assert target.read_text() == '{"ok": 1}'
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # not readable by other users
    plant(shared, "trace.json", precious)
    with pytest.raises(FileExistsError):
        replace_with(target, '{"ok": 2}')
    assert precious.read_text() == "precious"


def test_the_shared_dump_folder_is_sticky_and_a_job_folder_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    job = tmp_path / "plait-dumps" / "job"
    make_folder(job)
    assert stat.S_IMODE((tmp_path / "plait-dumps").stat().st_mode) == 0o1777
    assert stat.S_IMODE(job.stat().st_mode) == 0o700
    replace_with(job / "rank0.json", "{}")
    assert [p.name for p in job.iterdir()] == ["rank0.json"]


@pytest.mark.parametrize(("job", "filed"), [("..", "__"), (".", "_"), ("a/../b", "a_.._b")])
def test_a_job_id_never_names_the_folder_or_its_parent(job: str, filed: str) -> None:
    """PLAIT_JOB_ID=".." filed dumps beside the dump folder, not in a folder of their own."""
    assert places.safe_name(job) == filed


def test_a_rank_in_other_digits_is_no_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "²" passed str.isdigit and then raised ValueError out of int()."""
    monkeypatch.setenv("PLAIT_RANK", "²")
    assert places.global_rank() != 2
