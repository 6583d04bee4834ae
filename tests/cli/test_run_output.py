"""``plait run`` relays the ranks' output a whole line at a time, tagged or not, and loses none of
it when a rank crashes or the launcher's stdout goes away."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLAIT = [sys.executable, "-m", "plait"]

pytestmark = pytest.mark.multiprocess


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def run(args: list[str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*PLAIT, "run", *args], capture_output=True, timeout=60)


def test_a_line_is_never_split_by_another_ranks_line(tmp_path: Path) -> None:
    # Rank 0 has half a line out when rank 1 prints a whole one: the barriers order the writes.
    s = script(
        tmp_path,
        """
        import sys, plait
        with plait.init() as comm:
            if comm.rank == 0:
                sys.stdout.write("AAAA")  # unbuffered: written now
            comm.barrier()
            if comm.rank == 1:
                print("BBBB")
            comm.barrier()
            if comm.rank == 0:
                print("aaaa")
        """,
    )
    res = run(["-n", "2", s])
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [b"AAAAaaaa", b"BBBB"]


def test_a_line_over_a_mib_is_cut_into_lines_no_other_line_lands_in(tmp_path: Path) -> None:
    """Its first MiB was written unended, and another rank's line landed after it."""
    s = script(
        tmp_path,
        """
        import sys, plait
        with plait.init() as comm:
            if comm.rank == 0:
                sys.stdout.write("A" * 3_000_000)  # unbuffered: written now, in pieces
            comm.barrier()
            if comm.rank == 1:
                print("BBBB")
            comm.barrier()
            if comm.rank == 0:
                print("aaaa")
        """,
    )
    res = run(["-n", "2", s])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert b"BBBB" in lines  # a line of its own
    assert b"".join(line for line in lines if line != b"BBBB") == b"A" * 3_000_000 + b"aaaa"
    assert max(map(len, lines)) == 1 << 20


def test_a_line_just_over_a_mib_ended_in_the_same_read_is_cut_too(tmp_path: Path) -> None:
    """Only a MiB with no line end was cut: a line a little longer, whose end came in the
    read that took it past the MiB, went through whole (1,078,576 bytes)."""
    s = script(
        tmp_path,
        """
        import sys
        sys.stdout.write("B" * (1024 * 1024 + 30000) + "\\n")
        """,
    )
    res = run(["-n", "1", s])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [len(line) for line in lines] == [1 << 20, 30000]


def test_nothing_is_lost_when_a_rank_dies(tmp_path: Path) -> None:
    s = script(
        tmp_path,
        r"""
        import os, signal, sys
        for i in range(3):
            print("line", i)
        sys.stdout.write("progress 1\rprogress 2\rno newline yet")
        sys.stderr.write("last words")
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    res = run(["-n", "1", "--tag-output", s])
    assert res.returncode == 128 + 9
    assert res.stdout == (
        b"[0]: line 0\n[0]: line 1\n[0]: line 2\n"
        b"[0]: progress 1\r[0]: progress 2\r[0]: no newline yet\n"
    )
    assert res.stderr.startswith(b"[0]: last words\nplait run: rank 0 was killed by SIGKILL\n")


@pytest.mark.parametrize("tag", [True, False])
def test_ranks_that_print_a_lot(tmp_path: Path, tag: bool) -> None:
    s = script(
        tmp_path,
        """
        import os, sys
        rank = os.environ["PLAIT_RANK"]
        for i in range(20000):
            sys.stdout.write(f"{rank} {i:05d} {rank * 80}\\n")
        """,
    )
    res = run(["-n", "2", *(["--tag-output"] if tag else []), s])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.decode().splitlines()
    assert len(lines) == 40000
    for rank in "01":
        tagged = [line for line in lines if line.startswith(f"[{rank}]: " if tag else rank)]
        prefix = f"[{rank}]: " if tag else ""
        assert tagged == [f"{prefix}{rank} {i:05d} {rank * 80}" for i in range(20000)]


def test_a_line_of_exactly_a_mib_stays_whole(tmp_path: Path) -> None:
    """Its line end was counted toward the MiB: the line was cut before it, and an empty
    line followed."""
    s = script(
        tmp_path,
        """
        import sys
        sys.stdout.write("C" * (1024 * 1024) + "\\n" + "D" * 10 + "\\r\\n")
        sys.stdout.write("E" * (1024 * 1024) + "\\r\\n")
        """,
    )
    res = run(["-n", "1", s])
    assert res.returncode == 0, res.stderr
    assert [len(line) for line in res.stdout.splitlines()] == [1 << 20, 10, 1 << 20]


def test_a_closed_stdout_does_not_stall_the_ranks(tmp_path: Path) -> None:
    # `plait run ... | head -1`: the launcher drops what it cannot write and the job goes on.
    s = script(
        tmp_path,
        """
        for i in range(20000):
            print("x" * 100, i)
        """,
    )
    proc = subprocess.Popen(
        [*PLAIT, "run", "-n", "2", s], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith(b"x" * 100)
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert err == b""
