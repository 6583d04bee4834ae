"""Where calls are made: the first frame outside plait, and every thread's stack.

The flight recorder (:mod:`plait.diagnostics.recorder`) keeps a call's place in
the program in three ways, from the cheapest at call time to the dearest: a
call that ends well keeps none unless asked (``PLAIT_RECORDER_STACK``), and its
call shape keeps where a call of its kind was first made (:func:`caller_site`,
taken once per plan); a call still running when the recorder is dumped is found
on the stack of the thread that runs it (:func:`callers_in_flight`); a call
that fails, or is queued to run on another thread, takes its caller then. A
dump also holds the whole stack of every thread (:func:`threads`). Frames are
turned into ``[file, line, function]`` lists, the dump's form.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Protocol, TypeVar

__all__ = [
    "PLAIT_DIR",
    "caller_site",
    "callers_in_flight",
    "first_outside",
    "frame_json",
    "runs_calls",
    "threads",
]

#: plait's package folder, with a separator: frames from files under it are plait's own.
PLAIT_DIR = str(Path(__file__).resolve().parent.parent) + os.sep
#: This package's folder: a dump's own frames, left out of the dumping thread's stack.
_HERE = str(Path(__file__).resolve().parent) + os.sep
#: Frames kept per thread in a dump's ``threads``.
_THREAD_FRAMES = 64


class _Running(Protocol):
    """What :func:`callers_in_flight` reads of a recorder slot."""

    @property
    def seq(self) -> int: ...

    @property
    def end(self) -> float: ...

    @property
    def code(self) -> CodeType | None: ...


def caller_site() -> tuple[str, int, str] | None:
    """The first frame outside plait on this thread's stack: (file, line, function).

    For the slow paths that make a call's plan once per call shape (its
    :class:`~plait.diagnostics.recorder.CallShape`'s ``site``); None when
    every frame is plait's.
    """
    f = first_outside(sys._getframe(1))
    if f.f_code.co_filename.startswith(PLAIT_DIR):
        return None
    return (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)


#: The code of the functions that run a call with its slot in a variable named ``slot``.
_RUNNERS: set[CodeType] = set()

_F = TypeVar("_F", bound=Callable[..., Any])


def runs_calls(fn: _F) -> _F:
    """Mark ``fn`` as running a recorded call, its slot in its variable ``slot``.

    The function holds the call's number in its variable ``seq`` too: a slot
    reused by a newer call is not taken for the call still ending in ``fn``.
    A decorator for the call runner (:meth:`plait._runner.CallRunner._run`):
    :func:`callers_in_flight` looks for the frames of these functions only, so
    that another frame that happens to hold a slot (the stall watchdog's) is
    never taken for the call's. Costs nothing per call.
    """
    _RUNNERS.add(fn.__code__)
    return fn


def callers_in_flight(slots: Iterable[_Running], frames: int) -> dict[int, list[list[Any]]]:
    """The callers of the calls in flight that kept none, by ``id`` of their slot.

    Found where the call is: on the stack of the thread that runs it, in the
    frame of a function marked :func:`runs_calls` that holds the slot; the
    caller is the first frame outside plait from there outwards, with up to
    ``frames`` frames in all. Costs nothing per call and a walk of every
    thread's stack per dump (Note [recorder cost]).
    """
    wanted = {id(s): s for s in slots if s.end == 0.0 and s.code is None}
    found: dict[int, list[list[Any]]] = {}
    if not wanted:
        return found
    for top in sys._current_frames().values():
        f: FrameType | None = top
        while f is not None:
            if f.f_code in _RUNNERS:
                local = f.f_locals
                held = local.get("slot")
                mine = wanted.get(id(held)) if held is not None else None
                # The frame's own call, not one ending there in a slot a newer call has taken.
                if mine is held and mine is not None and local.get("seq") == mine.seq:
                    found.setdefault(id(mine), _stack_out(f, frames))
            f = f.f_back
    return found


def first_outside(f: FrameType) -> FrameType:
    """From ``f`` outwards, the first frame outside plait (the outermost if none is)."""
    while f.f_code.co_filename.startswith(PLAIT_DIR) and f.f_back is not None:
        f = f.f_back
    return f


def _stack_out(f: FrameType, frames: int) -> list[list[Any]]:
    """From ``f`` outwards: the first frame outside plait and the ones out from it."""
    return _frames_out(first_outside(f), frames)


def _frames_out(f: FrameType | None, limit: int) -> list[list[Any]]:
    """Up to ``limit`` frames from ``f`` outwards, each as ``[file, line, function]``."""
    stack: list[list[Any]] = []
    while f is not None and len(stack) < limit:
        stack.append([f.f_code.co_filename, f.f_lineno, f.f_code.co_name])
        f = f.f_back
    return stack


def _line(code: CodeType, lasti: int) -> int:
    """The source line of instruction offset ``lasti`` in ``code``."""
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return line
    return code.co_firstlineno


def frame_json(code: CodeType, lasti: int) -> list[Any]:
    """A kept frame (its code and instruction offset) as the dump's ``[file, line, function]``."""
    return [code.co_filename, _line(code, lasti), code.co_name]


def threads() -> list[dict[str, Any]]:
    """Every thread's stack now, innermost frame first (where a stuck rank is stuck)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            frame = frame.f_back or frame  # not the dump's own frames
            while frame.f_back is not None and frame.f_code.co_filename.startswith(_HERE):
                frame = frame.f_back
        stack = _frames_out(frame, _THREAD_FRAMES)
        out.append({"name": names.get(ident, str(ident)), "id": ident, "stack": stack})
    return out
