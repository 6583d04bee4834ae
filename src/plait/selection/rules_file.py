"""The rules file: the user's decision table for ``algorithm="auto"``, in TOML.

Where: PLAIT_RULES, else ``$XDG_CONFIG_HOME/plait/rules.toml``
(``~/.config/plait/rules.toml``), next to the profile ``plait tune`` writes.
Format: one array of tables per collective; within a collective the first
entry that holds the call and whose algorithm allows the call's op wins::

    [[allreduce]]
    algorithm = "recursive_doubling"
    bytes = "-64K"          # optional: lo-hi, half-open (lo <= bytes < hi), either end open
    hosts = "single"        # optional: "single" (all ranks on one host) or "multi"

    [[allreduce]]
    algorithm = "ring"
    bytes = "64K-"
    ranks = "3-"            # optional: lo-hi, half-open like bytes, or one number: ranks = 6
    segment = "256K"        # optional: pipelining unit in bytes (default 1M); or 262144

    [[broadcast]]
    algorithm = "binomial"

Sizes are integers with an optional K, M or G suffix (powers of 1024); bytes
are counted as ``auto`` counts them (the whole vector for allreduce, reduce
and broadcast; one rank's block for the block collectives), as in PLAIT_ALGO
(:mod:`plait.selection.overrides`). Precedence: PLAIT_ALGO, then this file,
then the measured profile (:mod:`plait.selection.model`), then the built-in
rules (:data:`plait.selection.select.RULES`).

Errors are loud on purpose. A file that cannot be read or parsed, an unknown
collective, algorithm or key, a bad size, range or hosts value, raises
:class:`RulesError` naming the file, the entry and what is expected, when a
communicator is created, before any collective runs. Quietly ignoring a bad
file could leave some ranks following it and others not, and ranks running
different schedules fail at best with MismatchError mid-job. A missing file is
no rules, except where PLAIT_RULES names it: a file that was asked for must be
there (point PLAIT_RULES at an empty file to run without any). As with
PLAIT_ALGO, every rank must read the same rules.
"""

from __future__ import annotations

import functools
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.algos._registry import COLLECTIVES, algorithms, get
from plait.selection.overrides import format_range, format_size, parse_range, parse_size

__all__ = ["Entry", "RulesError", "RulesFile", "default_path", "load", "parse"]

_KEYS = ("algorithm", "bytes", "ranks", "hosts", "segment")
_HOSTS = {"single": False, "multi": True}


class RulesError(ValueError):
    """A rules file that cannot be used; the message names the file, the entry and the fix."""


@dataclass(frozen=True)
class Entry:
    """Use ``algorithm`` (with ``segment`` bytes per message, None: the default) when in range.

    Ranges are half-open: ``lo <= x < hi``. ``multi_host``: True/False only
    when the ranks do/do not span several hosts; None: either.
    """

    collective: str
    algorithm: str
    lo: int = 0
    hi: float = float("inf")
    min_ranks: int = 1
    max_ranks: float = float("inf")
    multi_host: bool | None = None
    segment: int | None = None
    where: str = ""  # "[[allreduce]] entry 2", for messages and ``plait tune --show``

    def applies(self, size: int, nbytes: int, multi_host: bool) -> bool:
        """Whether a call of ``nbytes`` on ``size`` ranks is in this entry's range."""
        return (
            self.lo <= nbytes < self.hi
            and self.min_ranks <= size < self.max_ranks
            and (self.multi_host is None or self.multi_host == multi_host)
        )

    def describe(self) -> str:
        """The entry in one line, as the file would say it."""
        parts = [f"algorithm={self.algorithm}"]
        if self.lo or self.hi != float("inf"):
            parts.append(f"bytes={format_range(self.lo, self.hi)}")
        if self.min_ranks > 1 or self.max_ranks != float("inf"):
            hi = "" if self.max_ranks == float("inf") else str(int(self.max_ranks))
            parts.append(f"ranks={self.min_ranks}-{hi}")
        if self.multi_host is not None:
            parts.append("hosts=" + ("multi" if self.multi_host else "single"))
        if self.segment is not None:
            parts.append(f"segment={format_size(self.segment)}")
        return f"{self.where}: " + " ".join(parts)


@dataclass(frozen=True)
class RulesFile:
    """The entries of one rules file (``path``), in file order per collective."""

    path: str
    entries: tuple[Entry, ...]

    def match(
        self, collective: str, size: int, nbytes: int, *, commutative: bool, multi_host: bool
    ) -> Entry | None:
        """The first entry of ``collective`` that holds the call and allows its op."""
        for e in self.entries:
            if (
                e.collective == collective
                and e.applies(size, nbytes, multi_host)
                and get(collective, e.algorithm).supports(commutative=commutative)
            ):
                return e
        return None


def default_path() -> tuple[Path, bool]:
    """The rules file's path, and whether PLAIT_RULES named it (then it must exist)."""
    explicit = os.environ.get("PLAIT_RULES", "").strip()
    if explicit:
        return Path(explicit), True
    base = os.environ.get("XDG_CONFIG_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".config"
    )
    return Path(base) / "plait" / "rules.toml", False


def load() -> RulesFile | None:
    """The rules file at :func:`default_path`; None when there is none.

    Raises:
        RulesError: PLAIT_RULES names a missing file, or the file is unreadable or invalid.
    """
    path, explicit = default_path()
    try:
        st = path.stat()
    except FileNotFoundError:
        if explicit:
            raise RulesError(
                f"rules file {path} (PLAIT_RULES) does not exist; point PLAIT_RULES at a "
                "rules file, or at an empty file for none"
            ) from None
        return None
    except OSError as exc:
        raise RulesError(f"rules file {path}: cannot read it: {exc}") from None
    return _load(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int, size: int) -> RulesFile:
    """Read and parse ``path`` (cached per version of the file: mtime and size)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise RulesError(f"rules file {path}: cannot read it: {exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RulesError(f"rules file {path}: not UTF-8 text: {exc}") from None
    return parse(text, path)


def parse(text: str, path: str = "<rules>") -> RulesFile:
    """The rules in TOML ``text`` (``path`` names it in messages).

    Raises:
        RulesError: malformed TOML, or an entry that is not as the module docstring says.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RulesError(f"rules file {path}: not valid TOML: {exc}") from None
    entries: list[Entry] = []
    for collective, tables in data.items():
        if collective not in COLLECTIVES:
            raise RulesError(
                f"rules file {path}: unknown collective {collective!r}; expected "
                "[[collective]] tables for: " + ", ".join(COLLECTIVES)
            )
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise RulesError(
                f"rules file {path}: {collective} must be a list of entries, each in its own "
                f"[[{collective}]] table (double brackets)"
            )
        for i, table in enumerate(tables, 1):
            where = f"[[{collective}]] entry {i}"
            try:
                entries.append(_entry(collective, table, where))
            except ValueError as exc:
                raise RulesError(f"rules file {path}: {where}: {exc}") from None
    return RulesFile(path, tuple(entries))


def _entry(collective: str, table: dict[str, Any], where: str) -> Entry:
    """One entry of the file; ValueError saying what is wrong and what is expected."""
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; expected keys: " + ", ".join(_KEYS))
    algorithm = table.get("algorithm")
    names = runnable(collective)
    if not isinstance(algorithm, str) or algorithm not in names:
        if algorithm is None:
            got = "is missing"
        elif algorithm in algorithms(collective):
            got = f"= {algorithm!r} runs only in the simulator"
        else:
            got = f"= {algorithm!r} is unknown"
        raise ValueError(f"algorithm {got}; expected one of: " + ", ".join(names))
    lo, hi = 0, float("inf")
    if "bytes" in table:
        lo, hi = _range(table["bytes"], "bytes", 'a range like "0-64K" or "64K-"')
    min_ranks, max_ranks = 1, float("inf")
    if "ranks" in table:
        ranks = table["ranks"]
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            if ranks < 1:
                raise ValueError(f"ranks = {ranks!r}: a number of ranks is at least 1")
            min_ranks, max_ranks = ranks, ranks + 1
        else:
            lo_r, hi_r = _range(ranks, "ranks", 'a number or a range like "2-9" (2..8) or "16-"')
            min_ranks, max_ranks = max(lo_r, 1), hi_r
    multi_host = None
    if "hosts" in table:
        hosts = table["hosts"]
        if hosts not in _HOSTS:
            raise ValueError(f'hosts = {hosts!r}: expected "single" or "multi"')
        multi_host = _HOSTS[hosts]
    segment = None
    if "segment" in table:
        seg = table["segment"]
        if isinstance(seg, int) and not isinstance(seg, bool):
            segment = seg
        elif isinstance(seg, str):
            try:
                segment = parse_size(seg)
            except ValueError as exc:
                raise ValueError(f"segment = {seg!r}: {exc}") from None
        else:
            raise ValueError(f'segment = {seg!r}: expected bytes like "256K" or 262144')
        if segment < 1:
            raise ValueError(f"segment = {seg!r}: a segment is at least one byte")
    return Entry(collective, algorithm, lo, hi, min_ranks, max_ranks, multi_host, segment, where)


def runnable(collective: str) -> tuple[str, ...]:
    """``collective``'s algorithms that a communicator can run (for some op).

    Leaves out those that exist only for the simulator (in-network reduction).
    """
    return tuple(n for n in algorithms(collective) if get(collective, n).supports(commutative=True))


def _range(value: Any, key: str, expected: str) -> tuple[int, float]:
    if not isinstance(value, str) or "-" not in value:
        raise ValueError(f"{key} = {value!r}: expected {expected}, as a string")
    try:
        return parse_range(value)
    except ValueError as exc:
        raise ValueError(f"{key} = {value!r}: {exc}; expected {expected}") from None
