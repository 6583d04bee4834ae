"""No module of the package is over 700 lines.

A module that grows past that has more than one responsibility in it: split it
along a seam (as the communicator's rooms are split into the even, uneven and
object collectives) rather than raise the limit.
"""

from __future__ import annotations

from pathlib import Path

import plait

SRC = Path(plait.__file__).parent

#: The most lines a module under src/plait may have.
MAX_LINES = 700


def test_no_module_is_over_the_limit() -> None:
    sizes = {
        path.relative_to(SRC.parent).as_posix(): len(path.read_text().splitlines())
        for path in sorted(SRC.rglob("*.py"))
    }
    assert sizes, f"no modules found under {SRC}"
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along a seam):\n" + "\n".join(
        f"  {name}: {n} lines" for name, n in sorted(over.items(), key=lambda kv: -kv[1])
    )
