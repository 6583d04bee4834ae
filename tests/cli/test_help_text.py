"""Every subcommand's ``--help`` shows its module docstring's examples as written."""

from __future__ import annotations

import importlib
import io
import tokenize
from pathlib import Path

import pytest

from plait.cli.__main__ import SUBCOMMANDS, main


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_no_docstring_line_is_joined_to_the_next(name: str) -> None:
    """A backslash that ends a line of a plain docstring joins the two lines into one.

    ``plait store --help`` showed ``PLAIT_RANK=r   #   PLAIT_SIZE=4 python train.py``:
    the shell's continuation of its example, swallowed by Python. A docstring that ends
    a line with a backslash must be raw (``r\"\"\"``), as plait sim's is.
    """
    module = importlib.import_module(SUBCOMMANDS[name][0])
    assert module.__file__ is not None
    source = Path(module.__file__).read_text()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    first = next(t for t in tokens if t.type == tokenize.STRING)
    if "\\\n" in first.string:
        assert first.string[:1].lower() == "r", f"{name}: a line of its docstring ends in \\"


def test_store_help_shows_the_example_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["store", "--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("Example:")
    assert lines[start + 1 : start + 5] == [
        "  PLAIT_SECRET=s3cret plait store --host 0.0.0.0 --port 29600",
        "  # then on each host, for each of its ranks r (0 to 3 in all):",
        "  PLAIT_STORE=tcp://host0:29600 PLAIT_SECRET=s3cret PLAIT_RANK=r PLAIT_SIZE=4 \\",
        "      python train.py",
    ]
