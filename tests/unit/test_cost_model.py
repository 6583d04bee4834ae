"""The measured cost model: profile files, predictions (algorithm and segment), auto's use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import plait
from plait.cli.tune import fit
from plait.schedule.builder import HostLayout
from plait.selection import model
from plait.selection.select import SEGMENT_BYTES, Settings, choose, select
from plait.sim import formulas
from plait.testing import run_ranks

PROFILE = model.Profile(
    model.LinkCost(20e-6, 1 / 3e9), model.LinkCost(50e-6, 1 / 1e9), 1e-10, 1e-10
)


@pytest.fixture
def profile_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "profile.json"
    monkeypatch.setenv("PLAIT_PROFILE", str(path))
    monkeypatch.delenv("PLAIT_ALGO", raising=False)
    return path


def test_profile_round_trip(profile_file: Path) -> None:
    assert model.load() is None  # no file yet
    assert model.save(PROFILE) == profile_file
    assert model.load() == PROFILE
    data = json.loads(profile_file.read_text())
    assert data["version"] == model.VERSION


@pytest.mark.parametrize(
    "data",
    [
        {"version": 99, "intra": {"alpha": 1, "beta": 1}},
        {"version": model.VERSION},
        {"version": model.VERSION, "intra": {"alpha": -1, "beta": 1}},
        {"version": model.VERSION, "intra": {"alpha": "x", "beta": 1}},
    ],
)
def test_bad_profiles_are_refused(data: dict) -> None:
    with pytest.raises(ValueError, match="profile"):
        model.Profile.from_json(data)


def test_an_unreadable_profile_is_ignored(
    profile_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    profile_file.write_text("{not json")
    assert model.load() is None
    assert "ignoring the profile" in caplog.text


@pytest.mark.parametrize("text", ["[1, 2]", '"x"', "3", "null"])
def test_a_profile_that_is_not_an_object_is_ignored(
    profile_file: Path, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    """``[1, 2]`` raised AttributeError ('list' object has no attribute 'get') out of every
    rank's plait.init and of plait tune --show."""
    profile_file.write_text(text)
    assert model.load() is None
    assert "malformed profile: a JSON object expected" in caplog.text


def test_predict_best_is_the_formula_minimum() -> None:
    names = ["recursive_doubling", "ring", "rabenseifner", "direct"]  # direct: no formula
    for nbytes in (8, 4096, 1 << 20, 64 << 20):
        name, t = model.predict_best("allreduce", 8, nbytes, names, PROFILE)
        times = {
            n: formulas.predict("allreduce", n, 8, nbytes, 20e-6, 1 / 3e9, 1e-10, 1e-10)
            for n in names[:3]
        }
        assert name == min(times, key=times.get)
        assert t == times[name]
    assert model.predict_best("allreduce", 8, 8, ["direct", "ring"], PROFILE) is None


def test_auto_follows_the_profile_on_one_host(profile_file: Path) -> None:
    latency_bound = model.Profile(model.LinkCost(1.0, 1e-12))  # messages are all that count
    bandwidth_bound = model.Profile(model.LinkCost(0.0, 1.0), gamma=0.0)
    model.save(latency_bound)
    assert select("allreduce", 16, 64 << 20, commutative=True).name == "recursive_doubling"
    model.save(bandwidth_bound)
    assert select("allreduce", 16, 64 << 20, commutative=True).name in ("ring", "rabenseifner")
    # Across hosts the rules stay in charge.
    from plait.schedule.builder import HostLayout

    layout = HostLayout.from_names(["a"] * 8 + ["b"] * 8)
    assert select("allreduce", 16, 64 << 20, commutative=True, hosts=layout).name == "cascade"


def test_communicators_agree_under_a_profile(profile_file: Path) -> None:
    model.save(PROFILE)

    def body(comm: plait.Communicator) -> np.ndarray:
        return comm.allreduce(np.arange(1000.0) + comm.rank)

    for got in run_ranks(3, body):
        np.testing.assert_array_equal(got, np.arange(1000.0) * 3 + 3)


def test_fit_reads_alpha_and_beta() -> None:
    sizes = [8, 1024, 1 << 20, 4 << 20]
    times = [5e-6 + n * 1e-9 for n in sizes]
    alpha, beta = fit(sizes, times)
    assert alpha == pytest.approx(5e-6 + 8e-9)
    assert beta == pytest.approx(1e-9)


def test_plait_debug_info_logs_each_choice_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PLAIT_DEBUG", "info")
    caplog.set_level("INFO", logger="plait")

    def body(comm: plait.Communicator) -> None:
        for _ in range(3):
            comm.allreduce(np.ones(3))

    run_ranks(2, body)
    lines = [r.getMessage() for r in caplog.records if "auto chose" in r.getMessage()]
    assert sorted(lines) == [
        f"rank {r}: allreduce of 24 bytes on 2 ranks: auto chose arena_oneshot, "
        "segment 1 MiB (built-in rules)"
        for r in (0, 1)
    ]


@pytest.fixture
def fresh_model(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Forget cached predictions (before and after); returns the steps of each simulation."""
    from plait import sim

    model._predict.cache_clear()
    steps: list[int] = []
    real = sim.simulate

    def counting(*args: object, **kwargs: object) -> sim.Result:
        res = real(*args, **kwargs)  # type: ignore[arg-type]
        steps.append(res.steps)
        return res

    monkeypatch.setattr(sim, "simulate", counting)
    yield steps
    model._predict.cache_clear()


def test_small_calls_are_timed_by_the_formulas_alone(fresh_model: list[int]) -> None:
    got = choose("allreduce", 8, 4096, commutative=True, config=Settings(profile=PROFILE))
    assert (got.segment_bytes, got.source) == (SEGMENT_BYTES, "profile")
    assert fresh_model == []


def test_the_simulator_picks_a_segment_deterministically(fresh_model: list[int]) -> None:
    cfg = Settings(profile=PROFILE)
    first = choose("allreduce", 4, 4 << 20, commutative=True, config=cfg)
    assert first.source == "profile, simulated"
    assert first.segment_bytes in model.SEGMENTS
    assert 0 < sum(fresh_model) <= model.SIM_STEPS + max(fresh_model)  # the budget holds
    model._predict.cache_clear()
    assert choose("allreduce", 4, 4 << 20, commutative=True, config=cfg) == first
    # The winner is no slower, in the same simulator, than its algorithm at the default segment.
    from plait import sim

    net = sim.from_profile(PROFILE, 4)
    default = sim.simulate("allreduce", first.name, 4 << 20, net, dtype="u1", segment_bytes=None)
    chosen = sim.simulate(
        "allreduce", first.name, 4 << 20, net, dtype="u1", segment_bytes=first.segment_bytes
    )
    assert chosen.time <= default.time


def test_without_budget_the_formulas_or_the_rules_decide(
    fresh_model: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model, "SIM_STEPS", 0)
    cfg = Settings(profile=PROFILE)
    got = choose("allreduce", 16, 4 << 20, commutative=True, config=cfg)  # rules: a formula
    assert (got.segment_bytes, got.source) == (SEGMENT_BYTES, "profile")
    got = choose("allreduce", 4, 4 << 20, commutative=True, config=cfg)  # rules: direct
    assert (got.name, got.source) == ("direct", "built-in rules")
    layout = HostLayout([0, 0, 1, 1])
    got = choose("allreduce", 4, 4 << 20, commutative=True, hosts=layout, config=cfg)
    assert got.source == "built-in rules"
    assert fresh_model == []


@pytest.mark.parametrize(
    ("hosts", "profile", "source"),
    [
        ([0, 0, 1, 1], PROFILE, "profile, simulated"),
        ([0, 1, 0, 1], PROFILE, "built-in rules"),  # not numbered host by host
        ([0, 0, 0, 1], PROFILE, "built-in rules"),  # uneven
        ([0, 0, 1, 1], model.Profile(PROFILE.intra), "built-in rules"),  # no inter link
    ],
)
def test_across_hosts_the_simulator_predicts(
    fresh_model: list[int], hosts: list[int], profile: model.Profile, source: str
) -> None:
    layout = HostLayout(hosts)
    got = choose("allreduce", 4, 64 << 10, commutative=True, hosts=layout,
                 config=Settings(profile=profile))  # fmt: skip
    assert got.source == source
    assert got.spec.supports(commutative=True)


def test_across_hosts_a_slow_network_favours_fewer_crossings(fresh_model: list[int]) -> None:
    slow = model.Profile(model.LinkCost(1e-6, 1e-11), model.LinkCost(1e-3, 1e-7))
    layout = HostLayout([0, 0, 0, 0, 1, 1, 1, 1])
    got = choose("allreduce", 8, 1 << 20, commutative=True, hosts=layout,
                 config=Settings(profile=slow))  # fmt: skip
    assert got.source == "profile, simulated"
    assert got.name in ("hierarchical", "cascade")


def test_communicators_agree_on_a_simulated_choice(
    profile_file: Path, fresh_model: list[int]
) -> None:
    model.save(PROFILE)
    n = 40_000  # 320,000 bytes: a simulated choice

    def body(comm: plait.Communicator) -> tuple[np.ndarray, object]:
        out = comm.allreduce(np.arange(n, dtype=np.float64) + comm.rank)
        return out, comm._auto[("allreduce", n * 8, True, False, False)]

    results = run_ranks(3, body, window=0)  # the profile chooses among message algorithms
    want = np.arange(n, dtype=np.float64) * 3 + 3
    for out, _ in results:
        np.testing.assert_array_equal(out, want)
    choices = {choice for _, choice in results}
    assert len(choices) == 1
    assert choices.pop().source == "profile, simulated"


def test_one_host_without_two_formulas_the_simulator_decides(fresh_model: list[int]) -> None:
    cfg = Settings(profile=PROFILE)
    tiny = choose("gather", 4, 8, commutative=True, config=cfg)  # one algorithm, nothing to cut
    assert tiny.source == "built-in rules"
    assert fresh_model == []
    big = choose("gather", 4, 256 << 10, commutative=True, config=cfg)  # 1 MiB in all
    assert (big.name, big.source) == ("binomial", "profile, simulated")
    assert big.segment_bytes in model.SEGMENTS
    # alltoall: a formula for pairwise only, so both algorithms are simulated.
    got = choose("alltoall", 4, 1024, commutative=True, config=cfg)
    assert got.source == "profile, simulated"


def test_the_rules_choice_without_a_formula_is_simulated_too(fresh_model: list[int]) -> None:
    """Large vectors on 4 ranks: the rules say direct, which has no contention-free formula;
    it is simulated with the formulas' two best, and wins (no copy of the input, 2 latencies)."""
    cfg = Settings(profile=PROFILE)
    assert select("allreduce", 4, 4 << 20, commutative=True).name == "direct"  # the rules
    got = choose("allreduce", 4, 4 << 20, commutative=True, config=cfg)
    assert (got.name, got.source) == ("direct", "profile, simulated")
    # Small vectors: the rules' recursive doubling has a formula; nothing is added.
    small = choose("allreduce", 4, 256 << 10, commutative=True, config=cfg)
    assert small.name != "direct"


def test_more_ranks_than_cores_the_rules_decide(
    fresh_model: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from plait.selection import select as sel

    cfg = Settings(profile=PROFILE)
    assert choose("allreduce", 4, 8, commutative=True, config=cfg).source == "profile"
    monkeypatch.setattr(sel, "_cores", lambda: 2)  # 4 ranks, 2 cores: scheduling decides
    crowded = choose("allreduce", 4, 8, commutative=True, config=cfg)
    assert (crowded.name, crowded.source) == ("binomial", "built-in rules")
    assert choose("allreduce", 2, 8, commutative=True, config=cfg).source == "profile"


def test_the_rules_choice_too_big_to_simulate_keeps_the_call(fresh_model: list[int]) -> None:
    """Nothing weighs against the rules' direct when the simulator cannot time it."""
    cfg = Settings(profile=PROFILE)
    for size, nbytes in ((2, 128 << 20), (4, 128 << 20)):
        got = choose("allreduce", size, nbytes, commutative=True, config=cfg)
        assert (got.name, got.source) == ("direct", "built-in rules")
    # Without the rules' choice among the candidates (a non-commutative op still allows
    # direct, so use 16 ranks, where the rules pick Rabenseifner) the formulas decide.
    big = choose("allreduce", 16, 1 << 30, commutative=True, config=cfg)
    assert big.source == "profile"
