"""The uneven and object collectives between real processes, over shared memory and TCP.

Each runs once inside ``plait run`` (``uneven_check.py``), against the numpy
reference, on world sizes that are and are not powers of two.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_multiprocess import plait_run

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("transport", "nproc"), [("shm", 3), ("shm", 4), ("tcp", 2), ("tcp", 5)])
def test_uneven_and_object_collectives(transport: str, nproc: int) -> None:
    res = plait_run(["-n", str(nproc), "--transport", transport, str(HERE / "uneven_check.py")])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"ok on {nproc} ranks over" in res.stdout
