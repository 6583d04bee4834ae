"""A host's memory in the simulator: what copies, reductions and counter waits cost.

``plait sim`` charges every rank's copies (δ) and reductions (γ) at a typical
host's speed by default, for one-sided and message-passing algorithms alike, so
that their times compare; ``--gamma 0 --delta 0`` gives the network alone. A
one-sided post is seen after the network's wait latency where it is set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_one_sided import allreduce

from plait import sim
from plait.cli.__main__ import main
from plait.cli.sim import _DEFAULT_DELTA, _DEFAULT_GAMMA, parse_topology
from plait.schedule.builder import Context, record
from plait.schedule.ir import Schedule

N = 4 << 20  # bytes: a 4 MiB float32 allreduce
ALPHA, BETA, INTRA = 1e-6, 1 / 12.5e9, (2e-7, 1 / 50e9)  # plait sim's network defaults


def times(tmp_path: Path, *argv: str) -> dict[str, float]:
    """``plait sim allreduce -s 4M`` with ``argv``: per algorithm, the simulated seconds."""
    out = tmp_path / "sim.json"
    assert main(["sim", "allreduce", "-s", "4M", "--json", str(out), *argv]) == 0
    return {r["algorithm"]: r["time_s"] for r in json.loads(out.read_text())["results"]}


def test_the_defaults_are_a_hosts_memory() -> None:
    """Between 10 and 20 GB/s per rank: one core's numpy copy and add beyond its caches."""
    for per_byte in (_DEFAULT_GAMMA, _DEFAULT_DELTA):
        assert 1 / 20e9 <= per_byte <= 1 / 10e9


def test_an_arena_allreduce_takes_its_memory_work(tmp_path: Path) -> None:
    """4 ranks, 4 MiB: at least a copy of the vector at the copy bandwidth, and its work.

    Every rank copies 5/4 of the vector (the others' slices into its window, its
    own in and its result out), gets 3/4 (the others' results) and reduces 3/4
    (its slice from the three other windows), one step at a time: the time is that
    work plus a few counter waits.
    """
    t = times(tmp_path, "-n", "4", "-a", "arena")["arena"]
    assert t >= N * _DEFAULT_DELTA
    work = 2 * N * _DEFAULT_DELTA + 0.75 * N * _DEFAULT_GAMMA
    assert work <= t <= 1.05 * work


def test_an_arena_allreduce_is_near_its_measured_time(tmp_path: Path) -> None:
    """2 ranks, 4 MiB over shared memory: 498-506 µs measured (docs/performance.md).

    The model copies at the speed beyond the caches and not in place: within a factor 2.
    """
    t = times(tmp_path, "-n", "2", "-a", "arena")["arena"]
    assert 0.5 * 500e-6 <= t <= 2 * 500e-6


def test_ring_and_arena_compare_on_one_host(tmp_path: Path) -> None:
    """On one host of 4 ranks both pay for their memory work: their times are comparable."""
    t = times(tmp_path, "-n", "4", "--topology", "hosts:4", "-a", "arena,ring")
    assert 0.25 <= t["arena"] / t["ring"] <= 4
    # The ring's reductions (3/4 of the vector per rank) are in its time.
    free = times(tmp_path, "-n", "4", "--topology", "hosts:4", "-a", "ring", "--gamma", "0",
                 "--delta", "0")["ring"]  # fmt: skip
    assert t["ring"] >= free + 0.5 * 0.75 * N * _DEFAULT_GAMMA
    assert t["ring"] >= 0.75 * N * _DEFAULT_GAMMA


@pytest.mark.parametrize("topology", ["flat", "hosts:4"])
def test_free_local_work_is_the_network_alone(tmp_path: Path, topology: str) -> None:
    """``--gamma 0 --delta 0``: the times of the topologies' own defaults (γ = δ = 0)."""
    got = times(tmp_path, "-n", "4", "--topology", topology, "-a", "arena,ring", "--gamma", "0",
                "--delta", "0")  # fmt: skip
    if topology == "flat":
        net = sim.flat(4, ALPHA, BETA)
    else:
        net = sim.hosts(1, 4, sim.LinkParams(*INTRA), sim.LinkParams(ALPHA, BETA))
    for name in ("arena", "ring"):
        want = sim.simulate("allreduce", name, N, net, segment_bytes=None).time
        assert got[name] == pytest.approx(want, rel=1e-12)
    assert got["arena"] < 10e-6  # a few counter waits, no byte charged


def test_the_options_reach_the_network_and_the_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = ["sim", "-n", "4", "-a", "arena,ring", "-s", "1M", "--gamma", "1/10e9",
            "--delta", "1/20e9", "--wait-latency", "3e-6", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "# per rank: γ=1e-10 s/B (10 GB/s) reduced, δ=5e-11 s/B (20 GB/s) copied; " in text
    assert "a post seen 3e-06 s later" in text
    data = json.loads(out.read_text())
    assert (data["sim"]["gamma"], data["sim"]["delta"]) == (1e-10, 5e-11)
    assert data["sim"]["wait_latency"] == 3e-6
    net = parse_topology("flat", 4, ALPHA, BETA, 1e-10, INTRA, delta=5e-11, wait_latency=3e-6)
    assert net.wait_latency == 3e-6
    for r in data["results"]:
        want = sim.simulate("allreduce", r["algorithm"], 1 << 20, net, segment_bytes=None).time
        assert r["time_s"] == pytest.approx(want, rel=1e-12)
    # by default a post is seen after a message's latency
    assert main(["sim", "-n", "4", "-a", "arena", "-s", "1K"]) == 0
    assert "a post seen a message's latency later" in capsys.readouterr().out


def test_bad_costs_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--gamma", "--delta", "--wait-latency"):
        assert main(["sim", "-n", "4", "-a", "arena", "-s", "1K", flag, "-1"]) == 2
        assert "must be a finite number >= 0" in capsys.readouterr().err


def test_help_names_the_host_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    text = capsys.readouterr().out
    for flag in ("--gamma", "--delta", "--wait-latency S"):
        assert flag in text


# -- the wait latency in the Python API --------------------------------------------------

DELTA, GAMMA, ITEM = 1e-10, 2e-10, 4


everyone_reads_everyone = allreduce  # publish, then fold every window in rank order


def schedules(p: int, count: int) -> list[Schedule]:
    ctx = Context("allreduce", 0, p, count, ITEM, window=count * ITEM)
    return [record(everyone_reads_everyone, ctx.with_rank(r)) for r in range(p)]


@pytest.mark.parametrize("wait", [0.0, 5e-7, 4e-6])
def test_a_post_is_seen_after_the_wait_latency(wait: float) -> None:
    """Ranks 1..3: copy in, the wait latency after rank 0's post get its window, reduce 3."""
    count = 1 << 14
    nb = count * ITEM
    net = sim.flat(4, ALPHA, 1e-9, GAMMA, delta=DELTA, ports=False)
    net.set_wait_latency(wait)
    res = sim.simulate_schedules(schedules(4, count), net, ITEM)
    assert res.time == pytest.approx(2 * DELTA * nb + wait + 3 * GAMMA * nb, rel=1e-12)


def test_without_a_wait_latency_a_post_takes_a_messages_latency() -> None:
    """The default (None): as before, the latency of a message between the two ranks."""
    count = 1 << 14
    nb = count * ITEM
    net = sim.Network("flat", gamma=GAMMA, delta=DELTA)
    for _ in range(4):
        net.add_rank()
    net.set_router(lambda s, d: ())
    net.set_message_cost(ALPHA, 1e-9)
    assert net.wait_latency is None
    res = sim.simulate_schedules(schedules(4, count), net, ITEM)
    assert res.time == pytest.approx(2 * DELTA * nb + ALPHA + 3 * GAMMA * nb, rel=1e-12)
    keyword = sim.Network("flat", wait_latency=2e-7)
    assert keyword.wait_latency == 2e-7
    with pytest.raises(ValueError, match="wait latency must be a finite number >= 0"):
        net.set_wait_latency(-1.0)
