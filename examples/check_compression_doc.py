"""Check that docs/compression.md's measured table is what examples/compression.py prints.

::

    python examples/check_compression_doc.py                     # run the example, compare
    python examples/check_compression_doc.py --output saved.txt  # compare a saved output
    python examples/check_compression_doc.py --markdown          # print the doc's table rows

The doc's numbers are only worth something while the example still prints
them, so this script runs the command the doc gives, ``plait run -n 4
examples/compression.py`` (a minute or two on two cores), parses the table it
prints and the doc's table under "Measured: accuracy and bytes", and compares
every deterministic column exactly, as printed: the test accuracy, its
difference to ``none``, the bytes rank 0 sent and their ratio to ``none``.
The time column varies from run to run and is not compared; nor is the
``params`` digest, since another CPU or BLAS build may round the weights'
last bits differently. ``--markdown`` prints the doc's rows from the output,
to paste into the doc after a change that moves the numbers.

The example runs without PLAIT_ALGO, a rules file or a ``plait tune``
profile, whatever this machine has configured: each of them may change the
algorithm ``auto`` runs, and with it the bytes sent. Exit status: 0 when the
tables match, 1 when they differ (each difference is printed), 2 when the
example fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compression.md"
#: The command the doc gives; the doc must quote it word for word.
COMMAND = "plait run -n 4 examples/compression.py"
#: The example's line stating the setting; the doc's table is for this one.
SETTING = "4 ranks, 600 steps of 16 images per rank"
#: The heading of the doc's section that holds the table.
SECTION = "## Measured: accuracy and bytes"


@dataclass(frozen=True)
class Row:
    """One method's deterministic numbers, as printed (strings keep the printed precision)."""

    method: str
    accuracy: str  # percent, e.g. "98.61"
    vs_none: str  # percentage points, signed, e.g. "-0.28"
    bytes_sent: int
    ratio: str  # bytes relative to 'none', e.g. "0.5000"


# method, accuracy %, difference in pp, bytes, ratio, time, identical, digest
_OUTPUT_ROW = re.compile(
    r"(?P<method>\S+)\s+(?P<accuracy>\d+\.\d+)%\s+(?P<vs_none>[+-]\d+\.\d+)pp\s+"
    r"(?P<bytes>\d[\d,]*)\s+(?P<ratio>\d+\.\d+)\s+\d+\.\d+s\s+(?P<identical>True|False)\s+"
    r"[0-9a-f]+"
)
_DOC_ROW = re.compile(
    r"\|\s*`(?P<method>[^`]+)`\s*\|\s*(?P<accuracy>\d+\.\d+) %\s*\|"
    r"\s*(?P<vs_none>[+\-−]\d+\.\d+) pp\s*\|\s*(?P<bytes>\d[\d,]*)\s*\|\s*(?P<ratio>\d+\.\d+)\s*\|"
)


def _row(match: re.Match[str]) -> Row:
    return Row(
        match["method"],
        match["accuracy"],
        match["vs_none"].replace("−", "-"),
        int(match["bytes"].replace(",", "")),
        match["ratio"],
    )


def output_rows(text: str) -> list[Row]:
    """The rows of the table the example prints (after its header line ``method  test acc``).

    Raises:
        ValueError: no table, a malformed row, a replica that diverged, or the
            output is not for :data:`SETTING`.
    """
    lines = text.splitlines()
    if SETTING not in lines:
        raise ValueError(f"the example's output does not say {SETTING!r}")
    starts = [i for i, line in enumerate(lines) if re.match(r"method\s+test acc\b", line)]
    if not starts:
        raise ValueError("no table in the example's output")
    rows = []
    for line in lines[starts[-1] + 1 :]:
        if not line.strip():
            break
        match = _OUTPUT_ROW.fullmatch(line.strip())
        if match is None:
            raise ValueError(f"unexpected line in the example's table: {line!r}")
        if match["identical"] != "True":
            raise ValueError(f"{match['method']}: the replicas' weights differ")
        rows.append(_row(match))
    return rows


def doc_rows(markdown: str) -> list[Row]:
    """The rows of the doc's table in :data:`SECTION`.

    Raises:
        ValueError: no such section or table, a malformed row, or the section
            does not quote :data:`COMMAND`.
    """
    _, found, rest = markdown.partition("\n" + SECTION + "\n")
    if not found:
        raise ValueError(f"no section {SECTION!r} in the doc")
    section = rest.split("\n## ", 1)[0]
    if COMMAND not in section:
        raise ValueError(f"the section does not give the command {COMMAND!r}")
    lines = section.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("| method |")]
    if not starts:
        raise ValueError("no table in the section")
    rows = []
    for line in lines[starts[0] + 2 :]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        match = _DOC_ROW.fullmatch(line.strip())
        if match is None:
            raise ValueError(f"unexpected row in the doc's table: {line!r}")
        rows.append(_row(match))
    return rows


def compare(doc: list[Row], output: list[Row]) -> list[str]:
    """Every difference between the doc's rows and the example's, one sentence each."""
    problems = []
    doc_methods = [r.method for r in doc]
    out_methods = [r.method for r in output]
    if doc_methods != out_methods:
        problems.append(f"methods: the doc lists {doc_methods}, the example {out_methods}")
    printed = {r.method: r for r in output}
    for want in doc:
        got = printed.get(want.method)
        if got is None:
            continue
        problems.extend(
            f"{want.method}, {column}: the doc says {getattr(want, column)}, "
            f"the example printed {getattr(got, column)}"
            for column in ("accuracy", "vs_none", "bytes_sent", "ratio")
            if getattr(want, column) != getattr(got, column)
        )
    return problems


def markdown(rows: list[Row]) -> str:
    """The doc's table rows (below its header) for ``rows``, in the doc's notation."""
    return "\n".join(
        f"| `{r.method}` | {r.accuracy} % | {r.vs_none.replace('-', '−')} pp "
        f"| {r.bytes_sent:,} | {r.ratio} |"
        for r in rows
    )


def run_example(timeout: float = 900) -> str:
    """Run :data:`COMMAND` from the repository root; its stdout.

    PLAIT_ALGO is removed and PLAIT_RULES and PLAIT_PROFILE point at an empty
    file and a missing one, so that ``auto`` follows its built-in rules.

    Raises:
        subprocess.CalledProcessError: the example failed.
    """
    env = {k: v for k, v in os.environ.items() if k != "PLAIT_ALGO"}
    with tempfile.TemporaryDirectory() as tmp:
        env["PLAIT_RULES"] = os.devnull
        env["PLAIT_PROFILE"] = str(Path(tmp) / "no-profile.json")
        argv = [sys.executable, "-m", "plait", *COMMAND.split()[1:]]
        res = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    if res.returncode:
        raise subprocess.CalledProcessError(res.returncode, argv, res.stdout, res.stderr)
    return res.stdout


def main() -> int:
    """Compare (or, with --markdown, print) and return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", metavar="FILE", help="the example's saved output")
    parser.add_argument(
        "--markdown", action="store_true", help="print the doc's table rows instead"
    )
    args = parser.parse_args()
    if args.output:
        text = Path(args.output).read_text()
    else:
        print(f"running {COMMAND} ...", flush=True)
        try:
            text = run_example()
        except subprocess.CalledProcessError as exc:
            print(exc.stdout[-3000:] + exc.stderr[-3000:], file=sys.stderr)
            return 2
        print(text, end="")
    printed = output_rows(text)
    if args.markdown:
        print(markdown(printed))
        return 0
    problems = compare(doc_rows(DOC.read_text()), printed)
    for problem in problems:
        print(problem)
    if problems:
        noun = "difference" if len(problems) == 1 else "differences"
        print(f"{DOC.relative_to(ROOT)} does not match the example ({len(problems)} {noun})")
        return 1
    print(f"{DOC.relative_to(ROOT)} matches the example")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
