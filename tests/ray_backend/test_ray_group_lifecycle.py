"""The life of a plait Ray group with a real Ray: the keys it leaves, the order of creation,
badly configured groups.

One Ray instance (on loopback, 2 CPUs, no dashboard) and three actors serve the
module; each test uses group names of its own.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="plait.ray needs Ray: pip install 'plait[ray]'")

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(120),
    # Ray's own modules warn about deprecated APIs of their dependencies on import
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@ray.remote(num_cpus=0)
class Member:
    """An actor that joins plait groups through Ray's collective API."""

    def __init__(self) -> None:
        import plait.ray  # noqa: F401 - registers the backend in this process

    def ready(self) -> None:
        """Returns once the actor's process has started (and imported plait)."""

    def join(self, size: int, rank: int, name: str, timeout: float = 60.0) -> dict[str, Any]:
        """Create the group here, with PLAIT_TIMEOUT ``timeout``; what happened, and how long
        it took."""
        import ray.util.collective as col

        before = os.environ.get("PLAIT_TIMEOUT")
        os.environ["PLAIT_TIMEOUT"] = str(timeout)
        start = time.monotonic()
        try:
            col.init_collective_group(size, rank, backend="plait", group_name=name)
        except Exception as exc:
            return {
                "error": type(exc).__name__,
                "message": str(exc),
                "notes": list(getattr(exc, "__notes__", [])),
                "seconds": time.monotonic() - start,
            }
        finally:
            if before is None:
                del os.environ["PLAIT_TIMEOUT"]
            else:
                os.environ["PLAIT_TIMEOUT"] = before
        return {"error": None, "seconds": time.monotonic() - start}

    def join_in_order(self, size: int, rank: int, names: list[str], timeout: float) -> list[Any]:
        """Create the groups ``names`` one after another; stop at the first that fails."""
        done = []
        for name in names:
            done.append(self.join(size, rank, name, timeout))
            if done[-1]["error"]:
                break
        return done

    def destroy(self, *names: str) -> None:
        import ray.util.collective as col

        for name in names:
            col.destroy_collective_group(name)

    def token(self, name: str) -> str:
        from ray.util.collective.collective import get_group_handle

        return str(get_group_handle(name)._meeting.token)

    def allreduce(self, name: str, value: float) -> Any:
        import ray.util.collective as col

        x = np.full(4, value)
        col.allreduce(x, group_name=name)
        return x

    def allreduce_error(self, name: str) -> str | None:
        """The name of the error an all-reduce on the group raises (None: it returned)."""
        try:
            self.allreduce(name, 1.0)
        except Exception as exc:
            return type(exc).__name__
        return None


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """The module's one Ray instance (shut down, with every process, at the end)."""
    # The actor class travels by value: workers cannot import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def actors(cluster: None) -> Iterator[list[Any]]:
    """Three actors for the module; a test that kills one puts a fresh one in its place."""
    made = started(3)
    try:
        yield made
    finally:
        for a in made:
            ray.kill(a)


def started(n: int) -> list[Any]:
    """``n`` actors whose processes have started: the tests' own time limits (and the
    members' timeouts) then count the calls only, not Ray starting a worker on a busy
    machine (it took most of a minute with the other half of the suite beside it)."""
    made = [Member.remote() for _ in range(n)]
    ray.get([a.ready.remote() for a in made], timeout=300)
    return made


def keys_of(name: str) -> list[str]:
    """Every key plait keeps for the Ray group ``name`` in Ray's key-value store."""
    from plait.ray import RayKeyValue, group_namespace

    return RayKeyValue(group_namespace(ray.get_runtime_context().get_job_id(), name)).keys("")


def joined(results: list[dict[str, Any]]) -> None:
    """Every member created the group."""
    assert [r["error"] for r in results] == [None] * len(results), results


def test_survivors_of_a_dead_rank_0_leave_no_keys(actors: list[Any]) -> None:
    joined(ray.get([a.join.remote(3, r, "lost0") for r, a in enumerate(actors)], timeout=60))
    old = ray.get(actors[1].token.remote("lost0"), timeout=30)
    ray.kill(actors[0])
    ray.get([a.destroy.remote("lost0") for a in actors[1:]], timeout=30)
    assert not [k for k in keys_of("lost0") if old in k]
    assert keys_of("lost0") == []
    # Created again with a new rank 0: it works, and leaves nothing either.
    actors[0] = started(1)[0]
    joined(ray.get([a.join.remote(3, r, "lost0") for r, a in enumerate(actors)], timeout=60))
    got = ray.get([a.allreduce.remote("lost0", 1.0) for a in actors], timeout=60)
    np.testing.assert_array_equal(got[0], np.full(4, 3.0))
    assert keys_of("lost0") == []
    ray.get([a.destroy.remote("lost0") for a in actors], timeout=30)
    assert keys_of("lost0") == []


def test_groups_created_in_crossed_order_time_out_saying_so(actors: list[Any]) -> None:
    # Each waits in its first group for the other, which waits in its own first group.
    one, two = actors[:2]
    got = ray.get(
        [
            one.join_in_order.remote(2, 0, ["crossed-a", "crossed-b"], 2.0),
            two.join_in_order.remote(2, 1, ["crossed-b", "crossed-a"], 2.0),
        ],
        timeout=60,
    )
    for done in got:
        assert len(done) == 1, done  # stopped at the first group
        assert done[0]["error"] == "StoreTimeout", done
        assert any("in the same order on every member" in n for n in done[0]["notes"]), done


def test_groups_are_destroyed_in_any_order(actors: list[Any]) -> None:
    one, two = actors[:2]
    for name in ("order-x", "order-y"):
        joined(ray.get([one.join.remote(2, 0, name), two.join.remote(2, 1, name)], timeout=60))
    ray.get(
        [one.destroy.remote("order-x", "order-y"), two.destroy.remote("order-y", "order-x")],
        timeout=30,
    )
    for name in ("order-x", "order-y"):
        joined(ray.get([one.join.remote(2, 0, name), two.join.remote(2, 1, name)], timeout=60))
    got = ray.get([a.allreduce.remote(n, 1.0) for a in (one, two) for n in ("order-x", "order-y")])
    for g in got:
        np.testing.assert_array_equal(g, np.full(4, 2.0))
    # A member that destroys a group ends it for the others.
    ray.get(one.destroy.remote("order-x"), timeout=30)
    assert ray.get(two.allreduce_error.remote("order-x"), timeout=60) == "PeerLostError"
    ray.get([one.destroy.remote("order-y"), two.destroy.remote("order-x", "order-y")], timeout=30)


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([(0, 2), (0, 2)], "rank 0 was given to two actors"),
        ([(0, 3), (1, 3), (1, 3)], "rank 1 was given to two actors"),
        ([(0, 3), (1, 2)], "its members were given different world sizes (rank 0: 3, rank 1: 2)"),
    ],
)
def test_badly_configured_groups_fail_at_once(
    actors: list[Any], members: list[tuple[int, int]], match: str
) -> None:
    # A 10 s timeout: what each would wait, blaming a rank that never came, without the checks.
    # A name per case: a member of one case must not meet the last case's verdict.
    name = f"bad-{len(members)}-{members[-1][0]}"
    got = ray.get(
        [
            a.join.remote(size, rank, name, 10.0)
            for a, (rank, size) in zip(actors, members, strict=False)
        ],
        timeout=60,
    )
    for result in got:
        assert result["error"] == "RendezvousError", result
        assert f"Ray group {name!r}: {match}" in result["message"], result
        assert result["seconds"] < 3, result


def test_a_member_that_comes_after_a_bad_group_failed_fails_at_once(actors: list[Any]) -> None:
    # Rank 0 told world size 2, ranks 1 and 2 told 3; rank 2, configured right, comes after
    # the other two have failed. It learns why from rank 0's verdict, where it waited out
    # its timeout and blamed rank 0 for not creating the group.
    match = "its members were given different world sizes (rank 0: 2, rank 1: 3)"
    first = ray.get(
        [actors[0].join.remote(2, 0, "late", 10.0), actors[1].join.remote(3, 1, "late", 10.0)],
        timeout=60,
    )
    late = ray.get(actors[2].join.remote(3, 2, "late", 10.0), timeout=60)
    for result in [*first, late]:
        assert result["error"] == "RendezvousError", result
        assert f"Ray group 'late': {match}" in result["message"], result
        assert result["seconds"] < 3, result
    # Created again, right: it works and leaves no keys.
    joined(ray.get([a.join.remote(3, r, "late") for r, a in enumerate(actors)], timeout=60))
    ray.get([a.destroy.remote("late") for a in actors], timeout=30)
    assert keys_of("late") == []
