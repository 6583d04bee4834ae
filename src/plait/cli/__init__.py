"""The ``plait`` command line: one module per subcommand, registered in ``__main__``."""

from __future__ import annotations

import re

__all__ = ["plain"]

#: reStructuredText that docstrings use and a terminal shows raw: roles and inline literals.
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``text`` with reStructuredText markup removed, for a terminal (``--help``).

    ``:func:`plait.init``` becomes ``plait.init`` and a double-backquoted literal its
    bare text; a literal block's ``::`` becomes ``:`` at the end of a sentence and goes
    away on a line of its own (with the blank line after it), so that a subcommand's
    module docstring reads as plain text.
    """
    text = _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))
    lines: list[str] = []
    skip_blank = False
    for line in text.splitlines():
        if line.strip() == "::":
            skip_blank = True
            continue
        if skip_blank and not line.strip():
            skip_blank = False
            continue
        skip_blank = False
        lines.append(line[:-1] if line.endswith("::") else line)
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")
