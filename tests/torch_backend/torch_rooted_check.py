"""One rank of the gather/scatter tests of the torch backend; run by ``plait run -n N``.

Modes (first argument, comma-separated; each rank prints ``rank R: <mode>
passed``), the first three for every root and every way of calling
(blocking, and ``async_op=True`` finished by ``wait()`` or by the future):

- ``valid``: valid ``gather`` and ``scatter`` of float32 values with awkward
  bits (negative zero, subnormals, infinities), float64 and int64:
  bit-exact, strided list entries and outputs included;
- ``gather``: a ``gather_list`` with a tensor of the wrong size on the root:
  ValueError there, its list not written, the other ranks' calls complete;
- ``scatter``: a ``scatter_list`` with a tensor of the wrong size, a tensor
  of another dtype (through the group's own method: ``dist.scatter`` refuses
  mixed dtypes itself, before the backend), and the wrong number of tensors:
  the root raises its error and each rank whose share is wrong raises
  ValueError, with no tensor written on a rank that raises; the other ranks
  get their shares;
- ``async``: an async ``scatter`` on the ranks other than the root returns
  before the root has made its call (the root waits for them on a gloo
  group first).

After each failing call, an ``all_reduce`` on the same group gives the right
sum: the group stays usable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import plait.torch  # registers the "plait" backend

RANK = -1
_C10D = torch._C._distributed_c10d
#: What an output tensor holds before a call that must not write it.
SENTINEL = -7


def awkward(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Values for rank ``rank`` whose bits a conversion or a reduction would change."""
    n = int(np.prod(shape))
    rng = np.random.default_rng(1000 * salt + rank)
    if dtype == torch.int64:
        values = rng.integers(-(2**62), 2**62, n, dtype=np.int64)
        return torch.from_numpy(values).reshape(shape)
    kind = np.float32 if dtype == torch.float32 else np.float64
    values = rng.standard_normal(n).astype(kind) * kind(1e30)
    special = np.array([-0.0, np.finfo(kind).smallest_subnormal, np.inf, -np.inf], kind)
    values[: min(n, special.size)] = special[: min(n, special.size)]
    return torch.from_numpy(values).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements, in its logical order."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or not torch.equal(bits(got), bits(want)):
        raise AssertionError(f"rank {RANK}: {what}: got {got.tolist()}, expected {want.tolist()}")


def untouched(t: torch.Tensor, what: str) -> None:
    if not torch.equal(t, torch.full_like(t, SENTINEL)):
        raise AssertionError(f"rank {RANK}: {what}: the tensor was written: {t.tolist()}")


def finish(work: Any, how: str) -> None:
    """Finish an async call's work by ``wait()`` or by its future; a blocking call has none."""
    if how == "sync":
        assert work is None, work
    elif how == "wait":
        assert work.wait() is True
    else:
        work.get_future().wait()
        assert work.is_completed()
        assert work.is_success()


def fails(kind: type[BaseException], call: Callable[[], Any], how: str, words: list[str]) -> None:
    """``call`` (blocking, or async finished by ``how``) raises ``kind`` with ``words``."""
    error: BaseException | None = None
    try:
        work = call()
        if how != "sync":
            assert work is not None
            if how == "wait":
                work.wait()
            else:
                work.get_future().wait()
    except kind as exc:
        error = exc
    if error is None:
        raise AssertionError(f"rank {RANK}: {how}: no {kind.__name__} raised ({words})")
    assert not isinstance(error, plait.CommError), f"rank {RANK}: {how}: {error!r}"
    missing = [w for w in words if w not in str(error)]
    assert not missing, f"rank {RANK}: {how}: message lacks {missing}: {error}"


def still_usable(size: int, what: str) -> None:
    """A correct all_reduce on the group that the failed call ran on."""
    t = torch.full((3,), float(RANK + 1))
    dist.all_reduce(t)
    want = torch.full((3,), float(size * (size + 1) // 2))
    if not torch.equal(t, want):
        raise AssertionError(f"rank {RANK}: all_reduce after {what}: got {t.tolist()}")


def check_valid(size: int, rank: int, root: int, how: str, k: int) -> None:
    """Even lists: every element arrives bit for bit, strided entries and outputs too."""
    a = how != "sync"
    for dtype in (torch.float32, torch.float64, torch.int64):
        every = [awkward(r, (2, 3), dtype, k) for r in range(size)]
        gathered = None
        if rank == root:  # entry 0 strided, the last of another shape (element order counts)
            gathered = [torch.empty(3, 2, dtype=dtype).t()]
            gathered += [torch.empty(2, 3, dtype=dtype) for _ in range(1, size - 1)]
            gathered += [torch.empty(3, 2, dtype=dtype)]
        finish(dist.gather(every[rank], gathered, dst=root, async_op=a), how)
        if gathered is not None:
            for r in range(size):
                exact(gathered[r], every[r].reshape(gathered[r].shape), f"gather [{r}] {dtype}")
        parts = [awkward(10 + j, (2, 3), dtype, k) for j in range(size)]
        parts[-1] = parts[-1].t().contiguous().t()  # a strided entry: its logical order is sent
        got = torch.empty(3, 2, dtype=dtype).t()  # a strided output
        finish(dist.scatter(got, parts if rank == root else None, src=root, async_op=a), how)
        exact(got, parts[rank], f"scatter {dtype} {how}")


def check_wrong_gather(size: int, rank: int, root: int, how: str) -> None:
    """A gather_list entry of 3 elements for inputs of 2: ValueError on the root alone."""
    bad = (root + 1) % size
    a = how != "sync"
    mine = torch.full((2,), float(rank))
    if rank == root:
        gathered = [torch.full((3 if j == bad else 2,), float(SENTINEL)) for j in range(size)]
        words = [f"gather_list[{bad}] is float32 with 3 elements", "expected float32 with 2"]
        fails(ValueError, lambda: dist.gather(mine, gathered, dst=root, async_op=a), how, words)
        for j, t in enumerate(gathered):
            untouched(t, f"gather_list[{j}] of a refused gather ({how})")
    else:
        finish(dist.gather(mine, None, dst=root, async_op=a), how)
    still_usable(size, f"a wrong gather_list ({how})")


def raw_scatter(out: torch.Tensor, parts: list[torch.Tensor] | None, root: int, a: bool) -> Any:
    """The group's own scatter (as torch's front end calls it, without its dtype check)."""
    opts = _C10D.ScatterOptions()
    opts.rootRank = root
    opts.asyncOp = a
    work = dist.group.WORLD.scatter([out], [parts] if parts is not None else [], opts)
    return work if a else None


def check_wrong_scatter(size: int, rank: int, root: int, how: str) -> None:
    """A wrong scatter_list entry for rank ``bad`` (size, then dtype), then a list of the
    wrong length: the root and each rank whose share is wrong raise, without writing their
    tensors; the others get their shares."""
    bad = (root + 1) % size
    a = how != "sync"
    share = "does not fit this rank's tensor"
    cases: list[tuple[str, torch.Tensor, type[BaseException], list[str]]] = [
        ("size", torch.ones(3), ValueError,
         [f"scatter_list[{bad}] is float32 with 3 elements", "expected float32 with 2"]),
        ("dtype", torch.ones(2, dtype=torch.float64), TypeError,
         [f"scatter_list[{bad}] is float64", "expected float32"]),
    ]  # fmt: skip
    for case, wrong, kind, words in cases:
        parts = [torch.full((2,), 10.0 * j + 1) for j in range(size)]
        parts[bad] = wrong
        out = torch.full((2,), float(SENTINEL))
        mine = parts if rank == root else None

        def call(case: str = case, out: torch.Tensor = out, mine: Any = mine) -> Any:
            if case == "size":
                return dist.scatter(out, mine, src=root, async_op=a)
            return raw_scatter(out, mine, root, a)

        if rank == root:
            fails(kind, call, how, words)
        elif rank == bad:
            fails(ValueError, call, how, [f"scatter_list[{bad}]", share, "stays usable"])
        else:
            finish(call(), how)
            exact(out, parts[rank], f"scatter beside a wrong {case} ({how})")
        if rank in (root, bad):
            untouched(out, f"tensor of a refused scatter, wrong {case} ({how})")
        still_usable(size, f"a scatter_list of a wrong {case} ({how})")
    out = torch.full((2,), float(SENTINEL))
    short = [torch.ones(2)] * (size - 1) if rank == root else None
    if rank == root:
        words = [f"scatter_list has {size - 1} tensors", f"expected world size {size}"]
        fails(ValueError, lambda: raw_scatter(out, short, root, a), how, words)
    else:
        fails(ValueError, lambda: raw_scatter(out, short, root, a), how, [share])
    untouched(out, f"tensor of a scatter with a short list ({how})")
    still_usable(size, f"a short scatter_list ({how})")


def check_async_does_not_wait(size: int, rank: int, root: int, gloo: dist.ProcessGroup) -> None:
    """The ranks other than the root return from an async scatter before the root calls it:
    the root waits for them on the gloo group first (it would wait forever if they waited)."""
    out = torch.full((2,), float(SENTINEL))
    parts = [torch.full((2,), float(j)) for j in range(size)]
    if rank == root:
        dist.barrier(group=gloo)
        work = dist.scatter(out, parts, src=root, async_op=True)
    else:
        work = dist.scatter(out, None, src=root, async_op=True)
        dist.barrier(group=gloo)
    assert work.wait() is True
    exact(out, parts[rank], "async scatter")


def each_root(check: Callable[[int, int, int, str], None]) -> Callable[[int, int], None]:
    """A mode that runs ``check(size, rank, root, how)`` for every root and way of calling."""

    def mode(size: int, rank: int) -> None:
        for root in sorted({0, size - 1}):
            for how in ("sync", "wait", "future"):
                check(size, rank, root, how)

    return mode


def check_valid_all(size: int, rank: int, root: int, how: str) -> None:
    check_valid(size, rank, root, how, 3 * root + ("sync", "wait", "future").index(how))


def check_async(size: int, rank: int) -> None:
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    for root in sorted({0, size - 1}):
        check_async_does_not_wait(size, rank, root, gloo)
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)


MODES: dict[str, Callable[[int, int], None]] = {
    "valid": each_root(check_valid_all),
    "gather": each_root(check_wrong_gather),
    "scatter": each_root(check_wrong_scatter),
    "async": check_async,
}


def main() -> None:
    global RANK
    dist.init_process_group("plait")
    size, rank = dist.get_world_size(), dist.get_rank()
    RANK = rank
    for name in sys.argv[1].split(","):
        MODES[name](size, rank)
        dist.barrier()
        print(f"rank {rank}: {name} passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
