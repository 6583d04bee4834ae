"""``plait run -- W`` says why W cannot run as a command, truly: an executable file of the
current directory named without ``./`` is not on PATH (a shell would not run it either); it
is not "not executable"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plait.cli.__main__ import main as plait_main


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        plait_main(["run", "-n", "1", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("form", [["--"], ["--no-python"]], ids=["dashes", "no-python"])
def test_an_executable_here_named_without_a_slash_is_not_on_path(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    form: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "w.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    err = _refusal([*form, "w.sh", "x"], capsys)
    assert "not executable" not in err, err
    assert err == (
        "plait run: error: command not found: w.sh: it is not on PATH; to run the file w.sh "
        f"of this directory, give it as .{os.sep}w.sh\n"
    )


def test_a_directory_named_as_a_command_is_said_to_be_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "app").mkdir()
    err = _refusal(["--", f".{os.sep}app"], capsys)
    assert err == f"plait run: error: cannot run .{os.sep}app: it is a directory\n"
