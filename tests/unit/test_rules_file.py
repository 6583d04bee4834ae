"""The rules file: parsing, loud errors, precedence, and communicators that follow it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

import plait
from plait.schedule.builder import HostLayout
from plait.selection import model, rules_file
from plait.selection.overrides import parse
from plait.selection.rules_file import Entry, RulesError
from plait.selection.select import SEGMENT_BYTES, Settings, choose, settings
from plait.testing import memory_communicators, run_ranks

TWO_HOSTS = HostLayout([0, 0, 1, 1])


@pytest.fixture
def rules_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PLAIT_RULES at a file of this test's (not written yet)."""
    path = tmp_path / "rules.toml"
    monkeypatch.setenv("PLAIT_RULES", str(path))
    return path


def test_the_documented_example_parses() -> None:
    doc = rules_file.__doc__ or ""
    example = re.search(r"::\n\n(.*?)\n\n(?=\S)", doc, re.S)
    assert example is not None
    text = "\n".join(line[4:] for line in example.group(1).splitlines())
    got = rules_file.parse(text, "example.toml").entries
    assert got == (
        Entry("allreduce", "recursive_doubling", 0, 64 << 10, multi_host=False,
              where="[[allreduce]] entry 1"),
        Entry("allreduce", "ring", 64 << 10, float("inf"), 3, float("inf"), segment=256 << 10,
              where="[[allreduce]] entry 2"),
        Entry("broadcast", "binomial", where="[[broadcast]] entry 1"),
    )  # fmt: skip


def test_ranks_and_sizes() -> None:
    text = """
        [[allgather]]
        algorithm = "ring"
        ranks = 6
        segment = 4096
        [[allgather]]
        algorithm = "bruck"
        ranks = "2-5"
        bytes = "1KiB-2M"
    """
    exact, span = rules_file.parse(text).entries
    assert (exact.min_ranks, exact.max_ranks, exact.segment) == (6, 7, 4096)
    assert (span.min_ranks, span.max_ranks, span.lo, span.hi) == (2, 5, 1024, 2 << 20)
    assert span.applies(4, 1024, False)
    assert not span.applies(5, 1024, False)
    assert not span.applies(4, 2 << 20, False)
    assert exact.describe() == "[[allgather]] entry 1: algorithm=ring ranks=6-7 segment=4K"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[allreduce]]\nalgorithm = 'ring'\nbytes = '8K'", r"entry 1: bytes = '8K': expected"),
        ("[[allreduce]]\nalgorithm = 'ring'\nbytes = '8K-1K'", "is empty"),
        ("[[allreduce]]\nalgorithm = 'ring'\nbytes = 'x-'", "not a size"),
        ("[[allreduce]]\nalgorithm = 'ring'\nranks = 0", "at least 1"),
        ("[[allreduce]]\nalgorithm = 'ring'\nhosts = 'two'", 'expected "single" or "multi"'),
        ("[[allreduce]]\nalgorithm = 'ring'\nsegment = 0", "at least one byte"),
        ("[[allreduce]]\nalgorithm = 'ring'\nsegment = '1Q'", "not a size"),
        ("[[allreduce]]\nalgorithm = 'ring'\nsegment = 1.5", "expected bytes"),
        ("[[allreduce]]\nalgorithm = 'ring'\nsegement = 4096", "unknown key 'segement'"),
        ("[[allreduce]]\nalgorithm = 'nope'", "'nope' is unknown; expected one of: "),
        ("[[allreduce]]\nbytes = '8K-'", "algorithm is missing"),
        ("[[allreduce]]\nalgorithm = 'ring'\n[[allreduce]]\nalgorithm = 3", "entry 2: algorithm"),
        ("[allreduce]\nalgorithm = 'ring'", r"\[\[allreduce\]\] table \(double brackets\)"),
        ("[[allreduc]]\nalgorithm = 'ring'", "unknown collective 'allreduc'"),
        ("[[allreduce]\nalgorithm = 'ring'", "not valid TOML"),
    ],
)
def test_errors_name_the_file_the_entry_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(RulesError, match=message) as info:
        rules_file.parse(text, "/etc/my-rules.toml")
    assert str(info.value).startswith("rules file /etc/my-rules.toml: ")


def test_load_missing_unreadable_and_changed_files(
    rules_path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(RulesError, match="does not exist"):  # PLAIT_RULES asked for it
        rules_file.load()
    monkeypatch.delenv("PLAIT_RULES")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert rules_file.default_path() == (tmp_path / "config" / "plait" / "rules.toml", False)
    assert rules_file.load() is None  # the default place, empty: no rules
    monkeypatch.setenv("PLAIT_RULES", str(tmp_path))  # a directory
    with pytest.raises(RulesError, match="cannot read it"):
        rules_file.load()
    monkeypatch.setenv("PLAIT_RULES", str(rules_path))
    rules_path.write_bytes(b"\xff\xfe")
    with pytest.raises(RulesError, match="not UTF-8"):
        rules_file.load()
    rules_path.write_text("[[reduce]]\nalgorithm = 'binomial'\n")
    assert [e.algorithm for e in rules_file.load().entries] == ["binomial"]  # type: ignore[union-attr]
    rules_path.write_text("[[reduce]]\nalgorithm = 'rabenseifner'\n")  # a new size: reread
    assert [e.algorithm for e in rules_file.load().entries] == ["rabenseifner"]  # type: ignore[union-attr]


def test_the_first_matching_entry_wins_and_conditions_hold() -> None:
    rules = rules_file.parse(
        """
        [[allreduce]]
        algorithm = "ring"          # needs a commutative op: skipped for the others
        bytes = "-1M"
        hosts = "single"
        segment = "64K"
        [[allreduce]]
        algorithm = "direct"
        bytes = "-1M"
        [[allreduce]]
        algorithm = "hierarchical"
        hosts = "multi"
        ranks = "4-"
        """
    )
    cfg = Settings(rules=rules)

    def pick(
        size: int, nbytes: int, *, commutative: bool = True, hosts: HostLayout | None = None
    ) -> tuple[str, int, str]:
        c = choose("allreduce", size, nbytes, commutative=commutative, hosts=hosts, config=cfg)
        return c.name, c.segment_bytes, c.source

    assert pick(4, 100) == ("ring", 64 << 10, "rules file")
    assert pick(4, 100, commutative=False) == ("direct", SEGMENT_BYTES, "rules file")
    assert pick(4, 100, hosts=TWO_HOSTS) == ("direct", SEGMENT_BYTES, "rules file")
    assert pick(4, 8 << 20, hosts=TWO_HOSTS) == ("hierarchical", SEGMENT_BYTES, "rules file")
    assert pick(3, 8 << 20, hosts=HostLayout([0, 0, 1]))[2] == "built-in rules"  # 3 ranks
    assert pick(4, 8 << 20)[2] == "built-in rules"  # one host, 8 MiB: no entry
    assert choose("reduce", 4, 100, commutative=True, config=cfg).source == "built-in rules"


def test_precedence_plait_algo_then_rules_file_then_profile_then_built_in() -> None:
    rules = rules_file.parse("[[allreduce]]\nalgorithm = 'direct'\nbytes = '-1K'\n")
    plait_algo = parse("allreduce:ring:-100@8K")
    profile = model.Profile(model.LinkCost(1.0, 1e-12))  # latency is all: recursive doubling
    cfg = Settings(plait_algo, rules, profile)

    def source(nbytes: int, config: Settings = cfg) -> tuple[str, str]:
        c = choose("allreduce", 8, nbytes, commutative=True, config=config)
        return c.name, c.source

    assert source(10) == ("ring", "PLAIT_ALGO")
    assert source(500) == ("direct", "rules file")
    assert source(4096) == ("recursive_doubling", "profile")
    assert source(4096, Settings(plait_algo, rules)) == ("recursive_doubling", "built-in rules")
    assert choose("allreduce", 8, 10, commutative=True, config=cfg).segment_bytes == 8 << 10


def test_settings_come_from_the_environment(
    rules_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rules_path.write_text("[[broadcast]]\nalgorithm = 'scatter_allgather'\nsegment = '128K'\n")
    monkeypatch.setenv("PLAIT_ALGO", "reduce:rabenseifner")
    cfg = settings()
    assert cfg.rules is not None
    assert cfg.rules.path == str(rules_path)
    assert [o.algorithm for o in cfg.overrides] == ["rabenseifner"]
    got = choose("broadcast", 4, 8, commutative=True)  # reads the environment itself
    assert (got.name, got.segment_bytes) == ("scatter_allgather", 128 << 10)


def test_a_bad_rules_file_fails_when_the_communicator_is_made(rules_path: Path) -> None:
    rules_path.write_text("[[allreduce]]\nalgorithm = 'ring'\nbytes = '9-1'\n")
    with pytest.raises(RulesError, match=r"rules.toml: \[\[allreduce\]\] entry 1: bytes"):
        memory_communicators(2)


def test_communicators_run_the_rules_files_segment(rules_path: Path) -> None:
    """Ring cut into 1 KiB segments: more messages than the default, the same sums."""
    rules_path.write_text("[[allreduce]]\nalgorithm = 'ring'\nsegment = '1K'\n")
    n = 3000  # 24,000 bytes: eight 1 KiB segments per rank's chunk

    def body(comm: plait.Communicator) -> tuple[np.ndarray, int, int]:
        x = np.arange(n, dtype=np.float64) * (comm.rank + 1)
        out = comm.allreduce(x)
        choice = comm._auto[("allreduce", n * 8, True, True, False)]
        ring = comm._plans[(choice.spec, n, np.dtype(np.float64), plait.SUM, 0, 128)]
        forced = comm.allreduce(x, algorithm="ring")  # the caller's choice: default segment
        np.testing.assert_array_equal(forced, out)
        default = comm._plans[(choice.spec, n, np.dtype(np.float64), plait.SUM, 0, 1 << 17)]
        return out, len(ring.schedule.steps), len(default.schedule.steps)

    for out, cut, whole in run_ranks(3, body):
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float64) * 6)
        assert cut > whole


def test_the_example_in_the_performance_docs_parses() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "performance.md").read_text()
    block = re.search(r"```toml\n(.*?)```", doc, re.S)
    assert block is not None
    entries = rules_file.parse(block.group(1), "performance.md").entries
    assert [(e.algorithm, e.segment) for e in entries] == [
        ("recursive_doubling", None),
        ("ring", 256 << 10),
    ]


def test_settings_that_decide_alike_have_one_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # plait.init refused ranks whose rules files differed in section order only, whose
    # PLAIT_ALGO listed collectives in another order, or whose profiles' notes differed.
    from plait.selection import model
    from plait.selection.select import fingerprint, settings

    def print_of(**env: str) -> str:
        for name in ("PLAIT_ALGO", "PLAIT_RULES", "PLAIT_PROFILE"):
            monkeypatch.setenv(name, env.get(name, os.devnull if name == "PLAIT_RULES" else ""))
        if not env.get("PLAIT_PROFILE"):
            monkeypatch.setenv("PLAIT_PROFILE", str(tmp_path / "none.json"))
        return fingerprint(settings()).partition(" ")[0]

    one = tmp_path / "one.toml"
    one.write_text('[[allreduce]]\nalgorithm = "ring"\n[[broadcast]]\nalgorithm = "binomial"\n')
    two = tmp_path / "two.toml"
    two.write_text('[[broadcast]]\nalgorithm = "binomial"\n[[allreduce]]\nalgorithm = "ring"\n')
    assert print_of(PLAIT_RULES=str(one)) == print_of(PLAIT_RULES=str(two))
    assert print_of(PLAIT_ALGO="allreduce:ring,broadcast:binomial") == print_of(
        PLAIT_ALGO="broadcast:binomial,allreduce:ring"
    )
    noted = model.Profile(model.LinkCost(1.0, 1e-12), measured={"note": "copied"})
    for name, profile in (("a.json", model.Profile(model.LinkCost(1.0, 1e-12))), ("b.json", noted)):
        model.save(profile, tmp_path / name)
    assert print_of(PLAIT_PROFILE=str(tmp_path / "a.json")) == print_of(
        PLAIT_PROFILE=str(tmp_path / "b.json")
    )
    # What decides differently differs.
    assert print_of(PLAIT_ALGO="allreduce:ring") != print_of(PLAIT_ALGO="allreduce:direct")
    assert print_of(PLAIT_ALGO="allreduce:ring:0-8K,direct") != print_of(
        PLAIT_ALGO="allreduce:direct,ring:0-8K"
    )
    assert print_of() != print_of(PLAIT_PROFILE=str(tmp_path / "a.json"))
