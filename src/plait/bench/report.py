"""What ``plait bench`` shows and writes: the table, JSON, CSV and the plot.

Two derived columns are added to the rows the workers measured:

- ``limit_fraction``: busbw over the machine's relevant limit (with
  ``--limits``): loopback TCP throughput for TCP transports (plait over tcp,
  Open MPI over tcp, gloo), one core's memory copy bandwidth otherwise;
- ``plait_ratio`` (the ``plait/other`` column, compared systems only): how
  many times faster plait is at that size, ``time(other) / time(plait)``,
  which is also ``busbw(plait) / busbw(other)``; plait's time is that of its
  fastest series at the size. Above 1, plait is faster;
- ``model_us`` (plait's series, when a ``plait tune`` profile is loaded): the
  time the α-β-γ model that ``auto`` and the simulator share predicts for the
  algorithm that ran (:func:`plait.sim.formulas.predict` with the profile's
  link class: ``inter`` for the TCP transport when measured, else ``intra``),
  so that measured and modelled times sit side by side; ``-`` where no
  formula covers the algorithm.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from plait.bench.runner import Series

__all__ = [
    "CSV_FIELDS",
    "annotate",
    "document",
    "limit_for",
    "plot",
    "render",
    "write_csv",
]

CSV_FIELDS = [
    "system",
    "label",
    "transport",
    "requested",
    "bytes",
    "count",
    "algorithm",
    "warmup",
    "iters",
    "time_us",
    "p10_us",
    "p90_us",
    "algbw_gbps",
    "busbw_gbps",
    "wrong",
    "limit_fraction",
    "plait_ratio",
    "model_us",
]


def limit_for(series: Series, limits: dict[str, Any] | None) -> tuple[str, float] | None:
    """``(name, GB/s)`` of the limit a series' busbw is read against, or None without limits."""
    if not limits:
        return None
    if series.transport == "tcp":
        return "loopback TCP", float(limits["tcp_gbps"])
    return "memory copy, one core", float(limits["copy_gbps_1core"])


def annotate(
    series: Sequence[Series],
    limits: dict[str, Any] | None,
    *,
    collective: str = "allreduce",
    ranks: int = 0,
    profile: Any = None,
) -> None:
    """Add ``limit_fraction``, ``plait_ratio`` (compared systems) and, with a profile,
    ``model_us`` (plait's series) to every row, in place."""
    best: dict[int, float] = {}
    for s in series:
        if s.system != "plait":
            continue
        for r in s.rows:
            t = r.get("time_us", math.nan)
            if t == t and t > 0:
                best[r["bytes"]] = min(best.get(r["bytes"], math.inf), t)
    for s in series:
        limit = limit_for(s, limits)
        for r in s.rows:
            busbw = r.get("busbw_gbps", 0.0)
            r["limit_fraction"] = busbw / limit[1] if limit and limit[1] > 0 else None
            if s.system != "plait":
                mine, plait = r.get("time_us", math.nan), best.get(r["bytes"])
                r["plait_ratio"] = mine / plait if plait and mine == mine else None
            elif profile is not None and ranks > 1:
                r["model_us"] = _model_us(collective, r, ranks, s.transport, profile)


def _model_us(
    collective: str, row: dict[str, Any], ranks: int, transport: str, profile: Any
) -> float | None:
    """The profile's predicted time of the row's algorithm, in µs (None: no formula)."""
    from plait.selection.model import formula_time

    link = profile.inter if transport == "tcp" and profile.inter is not None else profile.intra
    t = formula_time(collective, row["algorithm"], ranks, row["bytes"], profile, link)
    return None if t is None else t * 1e6


def _num(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    if abs(x) >= 1000:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


# (header, width, row -> text); a negative width aligns left
_COLUMNS: list[tuple[str, int, Any]] = [
    ("bytes", 12, lambda r: str(r["bytes"])),
    ("count", 11, lambda r: str(r["count"])),
    ("  algorithm", -21, lambda r: "  " + r["algorithm"]),
    ("iters", 5, lambda r: str(r["iters"])),
    ("time_us", 10, lambda r: _num(r["time_us"])),
    ("p10_us", 10, lambda r: _num(r["p10_us"])),
    ("p90_us", 10, lambda r: _num(r["p90_us"])),
    ("algbw_GB/s", 11, lambda r: f"{r['algbw_gbps']:.3f}"),
    ("busbw_GB/s", 11, lambda r: f"{r['busbw_gbps']:.3f}"),
]
_LIMIT = (
    "%limit",
    7,
    lambda r: "-" if r.get("limit_fraction") is None else f"{100 * r['limit_fraction']:.0f}%",
)
_RATIO = ("plait/other", 12, lambda r: _num(r.get("plait_ratio")))
_MODEL = ("model_us", 10, lambda r: _num(r.get("model_us")))
_WRONG = ("wrong", 7, lambda r: str(r["wrong"]))


def _line(cells: list[tuple[str, int]], comment: bool = False) -> str:
    """Aligned cells (right, or left for a negative width); a header starts with ``#``."""
    text = "".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in cells)
    return "#" + text[1:] if comment else text


def _fit(width: int, header: str, cells: Sequence[str]) -> int:
    """``width`` grown to hold the header and every cell with a space to spare (sign kept)."""
    need = max([len(header), *(len(c) + 1 for c in cells)])
    return -max(-width, need) if width < 0 else max(width, need)


def _series_table(s: Series, limits: dict[str, Any] | None, where: str = "transport") -> list[str]:
    columns = list(_COLUMNS)
    if limits:
        columns.append(_LIMIT)
    if s.system != "plait":
        columns.append(_RATIO)
    if any("model_us" in r for r in s.rows):
        columns.append(_MODEL)
    columns.append(_WRONG)
    title = f"# {s.label} ({where} {s.transport}, algorithm {s.requested}"
    limit = limit_for(s, limits)
    title += f"; %limit of {limit[0]}, {limit[1]:.2f} GB/s)" if limit else ")"
    lines = ["#", title]
    if s.skipped:
        return [*lines, f"# skipped: {s.skipped}"]
    # Columns as wide as their header and their cells need (a long algorithm name, a
    # time of 10 digits): nothing is cut and every row lines up with the header.
    cells = [[f(r) for r in s.rows] for _, _, f in columns]
    widths = [_fit(w, h, texts) for (h, w, _), texts in zip(columns, cells, strict=True)]
    lines.append(_line([(h, w) for (h, _, _), w in zip(columns, widths, strict=True)], True))
    lines.extend(
        _line([(texts[i], w) for texts, w in zip(cells, widths, strict=True)])
        for i in range(len(s.rows))
    )
    if s.error:
        lines.append(f"# error: {s.error}")
    return lines


def _side_by_side(series: Sequence[Series]) -> list[str]:
    shown = [s for s in series if not s.skipped and s.rows]
    plaits = [s for s in shown if s.system == "plait"]
    others = [s for s in shown if s.system != "plait"]
    if not plaits or not others:
        return []
    cells = [("bytes", 12)] + [(s.label, max(11, len(s.label) + 2)) for s in plaits]
    for s in others:
        cells += [(s.label, max(11, len(s.label) + 2)), (f"plait/{s.label}", len(s.label) + 8)]
    by_bytes = [{r["bytes"]: r for r in s.rows} for s in shown]
    sizes = sorted({b for rows in by_bytes for b in rows})
    lines = [
        "#",
        "# side by side: median time (µs) of each system; plait/X = time(X) / time(plait's best),",
        "# how many times faster plait is (above 1: plait is faster)",
        _line(cells, comment=True),
    ]
    for b in sizes:
        row = [(str(b), 12)]
        for s in plaits:
            r = {x["bytes"]: x for x in s.rows}.get(b)
            row.append((_num(r["time_us"]) if r else "-", max(11, len(s.label) + 2)))
        for s in others:
            r = {x["bytes"]: x for x in s.rows}.get(b)
            row.append((_num(r["time_us"]) if r else "-", max(11, len(s.label) + 2)))
            row.append((_num(r.get("plait_ratio")) if r else "-", len(s.label) + 8))
        lines.append(_line(row))
    return lines


def render(
    header: Sequence[str],
    series: Sequence[Series],
    limits: dict[str, Any] | None,
    *,
    where: str = "transport",
) -> str:
    """The whole text report: header comments, one table per series, then side by side.

    ``where``: what a series' ``transport`` field names in its title (``plait sim``
    keeps the topology there).
    """
    lines = list(header)
    for s in series:
        lines.extend(_series_table(s, limits, where))
    lines.extend(_side_by_side(series))
    return "\n".join(lines) + "\n"


def document(
    meta: dict[str, Any], series: Sequence[Series], limits: dict[str, Any] | None
) -> dict[str, Any]:
    """Everything as one JSON-ready dict: the run's settings, the limits, every series."""
    return {"bench": meta, "limits": limits, "series": [asdict(s) for s in series]}


def write_csv(path: str, series: Sequence[Series]) -> None:
    """One line per series and row, with :data:`CSV_FIELDS` as the header."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for s in series:
            for r in s.rows:
                w.writerow(
                    {
                        "system": s.system,
                        "label": s.label,
                        "transport": s.transport,
                        "requested": s.requested,
                        **r,
                    }
                )


def plot(path: str, title: str, series: Sequence[Series], limits: dict[str, Any] | None) -> None:
    """busbw and time against size, one line per series, into an image file.

    Raises:
        ImportError: matplotlib is missing (``pip install 'plait[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from plait.bench.sweep import format_size

    fig, (bw_ax, t_ax) = plt.subplots(1, 2, figsize=(13, 5))
    for s in series:
        rows = [r for r in s.rows if r["bytes"] > 0 and r["time_us"] == r["time_us"]]
        if not rows:
            continue
        x = [r["bytes"] for r in rows]
        bw_ax.plot(x, [r["busbw_gbps"] for r in rows], marker=".", label=s.label)
        t_ax.plot(x, [r["time_us"] for r in rows], marker=".", label=s.label)
    if limits:
        for name, key, style in (
            ("memory copy, 1 core", "copy_gbps_1core", ":"),
            ("loopback TCP", "tcp_gbps", "--"),
        ):
            bw_ax.axhline(limits[key], color="grey", linestyle=style, linewidth=1, label=name)
    sizes = [r["bytes"] for s in series for r in s.rows if r["bytes"] > 0]
    ticks = []
    if sizes:
        lo, hi = math.ceil(math.log2(min(sizes))), math.floor(math.log2(max(sizes)))
        ticks = [1 << e for e in range(lo, hi + 1, max(1, (hi - lo + 7) // 8))]
    for ax in (bw_ax, t_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes (S)")
        ax.grid(True, which="major", alpha=0.3)
        if ticks:
            ax.set_xticks(ticks, [format_size(t) for t in ticks], rotation=45, fontsize=8)
    bw_ax.set_ylabel("busbw (GB/s)")
    t_ax.set_yscale("log")
    t_ax.set_ylabel("median time (µs)")
    bw_ax.legend(fontsize=8)
    t_ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
