"""torch's ``*_object`` functions on plait's object collectives, inside one process.

What ``import plait.torch`` does to ``torch.distributed``'s six object
functions (plait.torch._objects): the wrappers, their signatures, switching
them off, and on one-rank groups which path a call takes and that results and
errors are torch's. Multi-rank jobs against gloo: the ``objects`` mode of
``torch_rank_check.py`` (test_torch_jobs.py).
"""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed; the plait backend needs it (pip install 'plait[torch]')",
)
import torch.distributed as dist  # noqa: E402 - after the skip
from torch.distributed import distributed_c10d as c10d  # noqa: E402

from plait.torch import _objects  # noqa: E402

NAMES = _objects.NAMES


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    """A one-rank default group on the plait backend."""
    dist.init_process_group("plait", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of torch's pickling helpers called (torch's own object functions call them)."""
    calls: list[str] = []
    for name in ("_object_to_tensor", "_tensor_to_object"):
        real = getattr(c10d, name)

        def counted(*args: Any, _real: Callable[..., Any] = real, _name: str = name) -> Any:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(c10d, name, counted)
    return calls


def test_import_wraps_the_six_functions_in_both_modules() -> None:
    assert _objects.installed()
    for name in NAMES:
        wrapper = getattr(dist, name)
        assert getattr(c10d, name) is wrapper
        torch_fn = _objects.original(name)
        assert wrapper is not torch_fn
        assert wrapper.__wrapped__ is torch_fn
        assert wrapper.__name__ == name
        assert inspect.signature(wrapper) == inspect.signature(torch_fn)


def test_install_is_idempotent_and_uninstall_puts_torchs_back() -> None:
    wrappers = {name: getattr(dist, name) for name in NAMES}
    assert _objects.install()
    assert {name: getattr(dist, name) for name in NAMES} == wrappers
    try:
        _objects.uninstall()
        assert not _objects.installed()
        for name in NAMES:
            assert getattr(dist, name) is _objects.original(name) is getattr(c10d, name)
    finally:
        assert _objects.install()


@pytest.mark.parametrize(
    ("value", "on"),
    [(None, True), ("1", True), ("yes", True), ("0", False), ("false", False), (" OFF ", False)],
)
def test_the_switch(value: str | None, on: bool) -> None:
    env = {} if value is None else {_objects.ENV: value}
    assert _objects.enabled(env) is on


@pytest.mark.multiprocess
def test_switched_off_torchs_functions_stay() -> None:
    code = (
        "import torch.distributed as dist, plait.torch\n"
        "from plait.torch import _objects\n"
        "assert not _objects.installed()\n"
        "assert all(getattr(dist, n) is _objects.original(n) for n in _objects.NAMES)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, _objects.ENV: "0"},
        check=False,
    )
    assert res.returncode == 0, res.stderr


def test_without_a_group_torchs_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist.gather_object(1, [None])


def test_one_rank_results_through_plait(world: dist.ProcessGroup, torch_path: list[str]) -> None:
    item = {"a": np.arange(5.0), "t": torch.arange(3), "s": "text"}
    out: list[Any] = [None, "extra"]
    assert dist.all_gather_object(out, item) is None
    assert out[1] == "extra"
    assert out[0] is not item
    assert out[0]["s"] == "text"
    assert out[0]["a"].tolist() == list(range(5))
    assert out[0]["t"].tolist() == [0, 1, 2]
    out = [None]
    assert dist.gather_object(item, out, group_dst=0) is None
    assert out[0]["s"] == "text"
    box = [item, 2]
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    assert box[0] is item  # the source keeps its own objects
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, [item], group_src=0)
    assert mine[0]["a"].tolist() == list(range(5))
    assert torch_path == []


def test_empty_lists_are_sent_as_such(world: dist.ProcessGroup) -> None:
    dist.broadcast_object_list([], src=0)  # torch's own fails here on the source


@pytest.mark.parametrize(
    "call",
    [
        lambda: dist.gather_object(1, None),
        lambda: dist.gather_object(1, [None], dst=0, group_dst=0),
        lambda: dist.gather_object(1, [None], dst=3),
        lambda: dist.broadcast_object_list([1], src=0, group_src=0),
        lambda: dist.scatter_object_list([], [1]),
        lambda: dist.scatter_object_list((None,), [1]),
        lambda: dist.scatter_object_list([None], None),
        lambda: dist.send_object_list([1]),
        lambda: dist.send_object_list([1], dst=0),
        lambda: dist.recv_object_list([1]),
        lambda: dist.recv_object_list([1], group_src=0),
        lambda: dist.all_gather_object([None], 1, None, "no such argument"),
    ],
    ids=[
        "no gather list on dst",
        "dst and group_dst",
        "dst outside the group",
        "src and group_src",
        "empty output list",
        "output tuple",
        "no input on src",
        "send without dst",
        "send to itself",
        "recv without src",
        "recv from itself",
        "too many arguments",
    ],
)
def test_bad_arguments_raise_what_torch_raises(
    world: dist.ProcessGroup, call: Callable[[], Any]
) -> None:
    ours = raised(call)
    _objects.uninstall()
    try:
        torchs = raised(call)
    finally:
        _objects.install()
    assert type(ours) is type(torchs), (ours, torchs)
    if "3" not in str(torchs):  # torch's checks, torch's words; a root beyond the group: plait's
        assert str(ours) == str(torchs)


def raised(call: Callable[[], Any]) -> BaseException:
    """What ``call`` raises."""
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("nothing raised")


def test_other_backends_run_torchs_functions(torch_path: list[str]) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out: list[Any] = [None]
        dist.all_gather_object(out, {"x": 1})
        box = [np.arange(2)]
        dist.broadcast_object_list(box, src=0)
    finally:
        dist.destroy_process_group()
    assert out == [{"x": 1}]
    assert torch_path == ["_object_to_tensor", "_tensor_to_object", "_object_to_tensor"]


def test_a_replaced_pickler_keeps_torchs_path(
    world: dist.ProcessGroup, torch_path: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Pickler(pickle.Pickler):
        pass

    monkeypatch.setattr(c10d, "_pickler", Pickler)
    out: list[Any] = [None]
    dist.all_gather_object(out, "x")
    assert out == ["x"]
    assert torch_path == ["_object_to_tensor", "_tensor_to_object"]


def test_an_argument_not_served_keeps_torchs_path(
    world: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An argument of a later torch's that plait does not know sends the call to torch's."""
    seen: list[Any] = []

    def torch_fn(object_list: list[Any], obj: Any, group: Any = None, new: int = 0) -> None:
        seen.append(new)

    wrapper = _objects._wrap(
        torch_fn, _objects.all_gather_object, frozenset(("object_list", "obj", "group"))
    )
    out: list[Any] = [None]
    wrapper(out, "x", new=1)
    assert seen == [1]
    assert out == [None]
    wrapper(out, "x")
    assert seen == [1]
    assert out == ["x"]
