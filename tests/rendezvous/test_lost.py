"""Ranks a launcher files as dead end the start-up waits on them (Note [lost ranks])."""

from __future__ import annotations

import threading

import pytest

from plait.errors import PeerLostError, RendezvousError
from plait.rendezvous.lost import (
    JobRanks,
    Watched,
    filed,
    report_gave_up,
    report_lost,
    wait_ranks,
)
from plait.rendezvous.store import MemoryStore, PrefixStore, StoreTimeout


def test_nothing_filed_finds_nothing() -> None:
    store = MemoryStore()
    assert filed(JobRanks("init", store), [0, 1, 2]) == {}


def test_a_wait_through_the_jobs_ranks_ends_on_a_filed_rank() -> None:
    store = MemoryStore()
    group = PrefixStore("shm", JobRanks("init", store))  # a transport's view of the group
    group.set("ready/0", b"x")
    report_lost(store, 2, "was killed by SIGKILL")
    with pytest.raises(PeerLostError) as info:
        wait_ranks(
            group, ["ready/0", "ready/1", "ready/2"], [0, 1, 2], 60, me="rank 0", what="announce"
        )
    assert info.value.lost_rank == 2
    assert str(info.value).startswith("rank 0: rank(s) [2] died before they could announce")
    assert "rank 2 was killed by SIGKILL" in str(info.value)


def test_a_filed_rank_that_had_set_its_key_does_not_end_the_wait() -> None:
    store = MemoryStore()
    group = JobRanks("init", store)
    group.set("host/1", b"a")
    report_lost(store, 1, "was killed by SIGKILL")
    late = threading.Timer(1.5, lambda: group.set("host/0", b"b"))  # another rank, late
    late.start()
    try:
        wait_ranks(group, ["host/0", "host/1"], [0, 1], 60, me="rank 0", what="say their host")
    finally:
        late.cancel()


def test_ranks_outside_a_job_namespace_never_look() -> None:
    # A shrunk communicator renumbers its ranks: job rank 2 is not its rank 2.
    store = MemoryStore()
    report_lost(store, 1, "was killed by SIGKILL")
    group = PrefixStore("plait/init1/ft", store)
    assert filed(group, [1]) == {}
    with pytest.raises(StoreTimeout):
        wait_ranks(group, ["k/1"], [1], 0.2, me="rank 0", what="arrive")


def test_a_wait_that_nobody_ends_times_out_as_before() -> None:
    with pytest.raises(StoreTimeout):
        wait_ranks(JobRanks("init", MemoryStore()), ["k/1"], [1], 1.3, me="rank 0", what="arrive")


@pytest.mark.parametrize("kind", ["init", "shrink"])
def test_a_rank_that_gave_up_its_set_up_ends_the_waits_on_it(kind: str) -> None:
    """Note [ranks that gave up]: rank 1's shared-memory join failed on a dead rank of its
    host; rank 2, of another host, waited for rank 1's TCP address until its timeout, and
    named a live rank that "never published" it."""
    store = MemoryStore()
    if kind == "init":
        group: PrefixStore = JobRanks("plait/init1", store)
    else:
        group = Watched("ft/s1", store, lambda ranks: {}, "shrink")  # nobody died
    tcp = PrefixStore("tcp", group)  # the transports' views of the namespace
    report_gave_up(PrefixStore("shm", group), 1, "rank 1: rank(s) [3] died before ...")
    with pytest.raises(RendezvousError) as info:
        wait_ranks(tcp, ["addr/0", "addr/1"], [0, 1], 60, me="rank 2", what="publish")
    assert str(info.value) == (
        f"rank 2: rank(s) [1] gave up {'plait.init' if kind == 'init' else 'shrink'} before "
        "they could publish (rank 1: rank(s) [3] died before ...)"
    )
    # Filed in that namespace only: a later plait.init of the job meets in another.
    assert filed(JobRanks("plait/init2", store), [1]) == {}
    assert filed(store, [1]) == {}


def test_a_long_reason_in_any_script_is_filed_and_read_whole_characters() -> None:
    """A reason cut at 2000 bytes in the middle of a character made every waiting rank
    raise UnicodeDecodeError (not a CommError) instead of the set-up's error."""
    group = JobRanks("plait/init1", MemoryStore())
    report_gave_up(group, 1, "rank 1: cannot open /dev/shm/" + "é" * 1200)
    with pytest.raises(RendezvousError, match="cannot open /dev/shm/éé"):
        wait_ranks(group, ["addr/1"], [1], 60, me="rank 0", what="publish")


def test_a_survivor_that_gave_up_is_named_by_its_number_before_the_shrink_too() -> None:
    store = MemoryStore()
    group = Watched("ft/s1", store, lambda ranks: {}, "shrink", members=[1, 2, 3])
    report_gave_up(group, 1, "rank 1: its host lost a rank")
    with pytest.raises(RendezvousError, match=r"rank\(s\) \[1\] \(rank\(s\) \[2\] before "):
        wait_ranks(group, ["addr/1"], [1], 60, me="rank 0", what="publish")


def test_a_rank_that_set_its_key_then_died_ends_every_wait_alike() -> None:
    """Note [a key set before a death]: rank 1 sets its key and dies between the wait's
    look at the keys and its look at the deaths; the wait raised, while a wait of another
    rank that looked a moment later returned (shrink's survivors parted ways)."""
    store = MemoryStore()
    group: Watched

    def dead(ranks: object) -> dict[int, str]:
        group.set("connected/1", b"1")  # set just before the death the look finds
        return {1: "exited"}

    group = Watched("ft/s1", store, dead, "shrink", members=[0, 2])
    group.set("connected/0", b"1")
    wait_ranks(
        group, ["connected/0", "connected/1"], [0, 1], 60, me="rank 0", what="finish connecting"
    )
