"""The README's algorithm table lists exactly the registered algorithms."""

from pathlib import Path

import plait

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_table_matches_registry() -> None:
    rows = set()
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("`") and cells[0] in plait.COLLECTIVES:
            rows.add((cells[0], cells[1].strip("`")))
    registered = {(c, name) for c in plait.COLLECTIVES for name in plait.algorithms(c)}
    assert rows == registered
