"""The timeline merge command: the output it refuses, and inputs it cannot read, in one line."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.diagnostics import timeline
from plait.diagnostics.timeline import Timeline, merge, rank_path

PROG = "python -m plait.diagnostics.timeline"


def write_ranks(template: Path, size: int = 2) -> list[Path]:
    """Each rank's timeline of one exchange of 8 bytes with the next rank, as PLAIT_TIMELINE's."""
    paths = []
    t0 = time.monotonic()
    for r in range(size):
        tl = Timeline(rank_path(template, r), r)
        tl.step("send", (r + 1) % size, 8, 7, 0, t0, t0 + 0.001)
        tl.step("recv", (r - 1) % size, 8, 7, 1, t0, t0 + 0.002)
        written = tl.write()
        assert written is not None
        paths.append(written)
    return paths


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = timeline.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    """The single line of ``err``, which must be the command's own, not a traceback."""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{PROG}: ")
    return lines[0]


def test_the_forgotten_output_leaves_rank_0_as_it_was(tmp_path: Path) -> None:
    """``… timeline trace.rank*.json``: once the merge of the others over rank 0's file."""
    paths = write_ranks(tmp_path / "trace.json", 3)
    before = [p.read_bytes() for p in paths]
    res = subprocess.run(  # through a shell, which expands the pattern as for whoever types it
        f"{shlex.quote(sys.executable)} -m plait.diagnostics.timeline trace.rank*.json",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert res.returncode == 2
    assert res.stdout == ""
    line = one_line(res.stderr)
    assert "trace.rank0.json is rank 0's own timeline" in line
    assert "the first argument is the output" in line
    assert [p.read_bytes() for p in paths] == before
    assert sorted(q.name for q in tmp_path.iterdir()) == [p.name for p in paths]


def test_a_rank_file_of_any_name_is_refused_as_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``{rank}`` in PLAIT_TIMELINE, a rank's file has no ``.rank<r>`` to tell it by."""
    first, second = write_ranks(tmp_path / "t-{rank}.json")
    before = first.read_bytes()
    code, out, err = run_main([str(first), str(second)], capsys)
    assert (code, out) == (2, "")
    assert f"{first} is rank 0's own timeline" in one_line(err)
    assert first.read_bytes() == before
    with pytest.raises(ValueError, match="rank 0's own timeline"):  # the function refuses too
        merge([second], first)
    assert first.read_bytes() == before


def test_an_output_that_is_also_an_input_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = write_ranks(tmp_path / "trace.json")
    merged = tmp_path / "merged.json"
    assert run_main([str(merged), *map(str, paths)], capsys)[0] == 0
    before = merged.read_bytes()
    # The merged trace again among the inputs (merged.json matched by *.json) ...
    code, out, err = run_main([str(merged), str(merged), *map(str, paths)], capsys)
    assert (code, out) == (2, "")
    assert f"{merged} is both the output and an input" in one_line(err)
    assert merged.read_bytes() == before
    # ... or a rank's file, named by another path to it.
    other = tmp_path / "sub" / ".." / paths[1].name
    (tmp_path / "sub").mkdir()
    code, out, err = run_main([str(other), *map(str, paths)], capsys)
    assert (code, out) == (2, "")
    assert "is both the output and an input" in one_line(err)


def test_a_merged_trace_or_another_file_is_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = write_ranks(tmp_path / "trace.json")
    merged = tmp_path / "merged.json"
    for _ in range(2):  # a new file, then the merged trace of the run before
        code, out, err = run_main([str(merged), *map(str, paths)], capsys)
        assert (code, out, err) == (0, f"merged 2 timelines into {merged}\n", "")
    doc = json.loads(merged.read_text())
    assert doc["otherData"]["name"] == "plait timeline"
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}
    notes = tmp_path / "notes.json"
    notes.write_text('{"not": "a trace"}')
    assert run_main([str(notes), *map(str, paths)], capsys)[0] == 0
    # A one-rank job's merge holds one rank's events, and is not a rank's own file.
    one = tmp_path / "one.json"
    assert run_main([str(one), str(paths[0])], capsys)[0] == 0
    assert run_main([str(one), str(paths[0])], capsys)[0] == 0


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot be read (No such file or directory)"),
        ("", "cannot be read (Is a directory)"),
        ("print('hello')\n", "not JSON"),
        ('{"events": []}', "not a Chrome trace (no traceEvents list)"),
        ("[1, 2]", "not a Chrome trace (no traceEvents list)"),
        (b"\xff\xfe{}", "not a trace (not UTF-8 text)"),
    ],
    ids=["missing", "folder", "not-json", "no-trace-events", "array", "not-utf8"],
)
def test_an_input_that_is_not_a_trace_is_named_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | bytes | None, says: str
) -> None:
    paths = write_ranks(tmp_path / "trace.json")
    bad = tmp_path / "bad.json"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    elif content == "":
        bad.mkdir()
    elif content is not None:
        bad.write_text(content)
    merged = tmp_path / "merged.json"
    code, out, err = run_main([str(merged), str(paths[0]), str(bad), str(paths[1])], capsys)
    assert (code, out) == (2, "")
    line = one_line(err)
    assert line.startswith(f"{PROG}: {bad}: {says}")
    assert line.endswith("expected a rank's timeline as PLAIT_TIMELINE writes it (a Chrome trace)")
    assert not merged.exists()


def test_an_output_that_cannot_be_written_is_named_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = write_ranks(tmp_path / "trace.json")
    out_path = tmp_path / "no-such-folder" / "merged.json"
    code, out, err = run_main([str(out_path), *map(str, paths)], capsys)
    assert (code, out) == (1, "")
    assert one_line(err) == f"{PROG}: {out_path}: cannot be written (No such file or directory)"


def test_the_help_says_which_output_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        timeline.main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"usage: {PROG} [-h] OUT.json RANK.json [RANK.json ...]" in text
    assert "The first argument is the output" in text
    assert "a rank's own timeline" in text
    assert "2 when nothing was" in text
