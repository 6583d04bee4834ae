"""Transport tests: leak checks for shared-memory segments that see only this test's own transports.

Another plait job on the same machine (a second test run, a user's job) creates and
removes ``/dev/shm/plait-*`` files of its own at any time, so a check that compared the
whole directory before and after a test would blame this test for them. Instead, every
segment path a ShmTransport of this process creates during the test is recorded, and only
those must be gone at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from plait.transport.shm import segment


@pytest.fixture
def own_segments(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The segment paths this test's transports created; after the test none may remain."""
    created: list[str] = []
    original = segment.create

    def recording(path: str, nbytes: int, me: int, job: str, **kw: Any) -> segment.Segment:
        created.append(path)
        return original(path, nbytes, me, job, **kw)

    monkeypatch.setattr(segment, "create", recording)
    yield created
    left = [p for p in created if os.path.exists(p)]
    assert left == [], f"segments left behind: {left}"
