"""The lanes of send_object and recv_object (Note [one object at a time on a lane] and Note [an
object cut short] in plait._object_methods)."""

from __future__ import annotations

import threading

import pytest

import plait
from plait._object_methods import Lanes

pytestmark = pytest.mark.timeout(60)


def test_a_thread_waiting_for_a_lane_that_gets_spoiled_is_refused() -> None:
    """A thread already waiting for the lane when its holder spoiled it went on to send on
    it: the spoiled mark was read only before the wait."""
    lanes, key = Lanes(), ("send", 1, 3)
    holding, waiting = threading.Event(), threading.Event()
    got: list[BaseException | None] = []

    def second() -> None:
        assert holding.wait(30)
        waiting.set()  # (it then blocks on the lane's lock until the holder lets go)
        try:
            with lanes.hold(key, 30, "second"):
                got.append(None)
        except plait.CommError as exc:
            got.append(exc)

    t = threading.Thread(target=second)
    t.start()
    with lanes.hold(key, 30, "first"):
        holding.set()
        assert waiting.wait(30)
        while _waiters(lanes, key) < 2:  # until the second thread counts itself on the lane
            threading.Event().wait(0.001)
        lanes.spoil(key, "an earlier send_object failed partway")
    t.join(30)
    assert len(got) == 1, got
    assert isinstance(got[0], plait.CommError), got
    assert "an earlier send_object failed partway; use another tag" in str(got[0])


def _waiters(lanes: Lanes, key: tuple[str, int, int]) -> int:
    lane = lanes._lanes.get(key)
    return 0 if lane is None else int(lane[1])
