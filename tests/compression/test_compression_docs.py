"""docs/compression.md's measured table is what examples/compression.py prints.

The comparison itself is examples/check_compression_doc.py's: the fast tests
here check that it parses both tables and notices every kind of difference;
the slow one runs the example as the doc says and compares. Training needs
scikit-learn's digits; those tests skip without it.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType

import pytest

from examples_loader import load_example
from plait.testing import run_ranks


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("compression")


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_example("check_compression_doc")


@pytest.fixture(scope="module")
def documented(check: ModuleType) -> list:
    return check.doc_rows(check.DOC.read_text())


def _output(example: ModuleType, results: list, setting: str = "4 ranks, 600 steps") -> str:
    """What the example prints after training on ``results``, ``setting`` as its header."""
    return f"(progress lines)\n\n{setting} of 16 images per rank\n\n{example.table(results)}\n"


def _results(example: ModuleType, seconds: float = 1.0) -> list:
    """Results whose printed rows are known: 'none' and two methods, one better, one worse."""
    return [
        example.Result("none", 351 / 360, 46_128_000, seconds, True, "ab" * 32),
        example.Result("int8", 354 / 360, 8_823_600, 2 * seconds, True, "cd" * 32),
        example.Result("topk-1%", 350 / 360, 1_411_200, 3 * seconds, True, "ef" * 32),
    ]


def test_the_doc_lists_every_method_of_the_example_in_order(
    example: ModuleType, documented: list
) -> None:
    assert [r.method for r in documented] == list(example.METHODS)


def test_the_example_table_parses_to_what_it_printed(
    example: ModuleType, check: ModuleType
) -> None:
    rows = check.output_rows(_output(example, _results(example)))
    assert rows == [
        check.Row("none", "97.50", "+0.00", 46_128_000, "1.0000"),
        check.Row("int8", "98.33", "+0.83", 8_823_600, "0.1913"),
        check.Row("topk-1%", "97.22", "-0.28", 1_411_200, "0.0306"),
    ]


def test_markdown_rows_parse_back_as_doc_rows(example: ModuleType, check: ModuleType) -> None:
    rows = check.output_rows(_output(example, _results(example)))
    header = "| method | test accuracy | vs none | bytes sent by rank 0 | bytes vs none |\n|---|\n"
    doc = f"# t\n\n{check.SECTION}\n\nRun `{check.COMMAND}`.\n\n{header}{check.markdown(rows)}\n"
    assert "−0.28 pp" in doc  # the doc's minus sign
    assert check.doc_rows(doc) == rows


def test_timings_and_digests_are_not_compared(example: ModuleType, check: ModuleType) -> None:
    a = check.output_rows(_output(example, _results(example, seconds=1.0)))
    slower = [dataclasses.replace(r, digest="0" * 64) for r in _results(example, seconds=7.5)]
    b = check.output_rows(_output(example, slower))
    assert check.compare(a, b) == []


@pytest.mark.parametrize(
    ("column", "value"),
    [("accuracy", "98.34"), ("vs_none", "-0.27"), ("bytes_sent", 8_823_601), ("ratio", "0.1914")],
)
def test_every_changed_column_is_reported(
    check: ModuleType, documented: list, column: str, value: object
) -> None:
    printed = list(documented)
    i = next(i for i, r in enumerate(printed) if r.method == "int8")
    printed[i] = dataclasses.replace(printed[i], **{column: value})
    problems = check.compare(documented, printed)
    assert len(problems) == 1
    assert problems[0].startswith(f"int8, {column}: the doc says")


def test_missing_and_reordered_methods_are_reported(check: ModuleType, documented: list) -> None:
    assert check.compare(documented, documented) == []
    assert check.compare(documented, documented[:-1])
    assert check.compare(documented, documented[::-1])


def test_output_of_another_setting_or_diverged_replicas_is_refused(
    example: ModuleType, check: ModuleType
) -> None:
    results = _results(example)
    with pytest.raises(ValueError, match="does not say"):
        check.output_rows(_output(example, results, setting="2 ranks, 600 steps"))
    results[1] = dataclasses.replace(results[1], identical=False)
    with pytest.raises(ValueError, match="int8: the replicas' weights differ"):
        check.output_rows(_output(example, results))


def test_a_doc_without_the_command_is_refused(check: ModuleType) -> None:
    text = check.DOC.read_text().replace(check.COMMAND, "plait run -n 2 examples/compression.py")
    with pytest.raises(ValueError, match="does not give the command"):
        check.doc_rows(text)


@pytest.mark.slow  # trains the example twice
def test_training_is_bit_identical_from_run_to_run(example: ModuleType) -> None:
    """The same weights, to the bit, on every rank and in two runs; another method differs."""
    pytest.importorskip("sklearn", reason="the digits data set comes with scikit-learn")
    digests = {}
    for method in ("int8-stochastic", "topk-1%", "powersgd-r1"):
        runs = [
            run_ranks(4, lambda comm, m=method: example.train(comm, m, steps=20)) for _ in range(2)
        ]
        assert {r.digest for run in runs for r in run} == {runs[0][0].digest}, method
        assert all(r.identical for run in runs for r in run)
        digests[method] = runs[0][0].digest
    assert len(set(digests.values())) == len(digests)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(
    os.environ.get("PLAIT_CHECK_DOCS") != "1",
    reason="opt-in (a minute or two): set PLAIT_CHECK_DOCS=1, or run "
    "python examples/check_compression_doc.py",
)
def test_the_documented_table_is_what_the_example_prints(
    check: ModuleType, documented: list
) -> None:
    """Runs ``plait run -n 4 examples/compression.py`` (a minute or two on two cores)."""
    pytest.importorskip("sklearn", reason="the digits data set comes with scikit-learn")
    output = check.run_example(timeout=1100)
    assert check.compare(documented, check.output_rows(output)) == [], output
