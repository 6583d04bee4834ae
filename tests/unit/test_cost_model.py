"""The measured cost model: profile files, predictions, and auto's use of them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import plait
from plait.cli.tune import fit
from plait.selection import model
from plait.selection.select import select
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
        f"rank {r}: allreduce of 24 bytes on 2 ranks: auto chose recursive_doubling, "
        "segment 1 MiB (built-in rules)"
        for r in (0, 1)
    ]
