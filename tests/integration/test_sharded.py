"""Sharded channels, the ZeRO-style optimizer and bounded staleness, against numpy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import plait
from plait.sharded import Channels, ShardedOptimizer, StaleAverager
from plait.testing import memory_communicators, run_ranks


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 7, 1000, 100_003])
def test_channels_allreduce(channels: int, count: int) -> None:
    size = 3

    def body(comm: plait.Communicator) -> np.ndarray:
        x = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
        with Channels(comm, channels) as ch:
            out = ch.allreduce(x)
            again = np.empty_like(x)
            assert ch.allreduce(x, out=again) is again
            np.testing.assert_array_equal(again, out)
        return out

    out = run_ranks(size, body)
    want = sum(np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(3))
    np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-5)
    for r in (1, 2):
        assert out[r].tobytes() == out[0].tobytes()


def test_channels_reject_a_wrong_out() -> None:
    def body(comm: plait.Communicator) -> None:
        with Channels(comm, 2) as ch, pytest.raises(ValueError, match="expected"):
            ch.allreduce(np.ones(4), out=np.ones(5))

    run_ranks(2, body)


def test_channels_return_the_kind_the_communicator_returns() -> None:
    """A JAX or torch x gives a result of its kind, as ``comm.allreduce(x)`` does."""
    jnp = pytest.importorskip("jax.numpy")
    torch = pytest.importorskip("torch")

    def body(comm: plait.Communicator) -> list[Any]:
        base = np.arange(6, dtype=np.float32) * (comm.rank + 1)
        with Channels(comm, 2) as ch:
            got = [ch.allreduce(jnp.asarray(base)), ch.allreduce(torch.from_numpy(base.copy()))]
            for g in got:
                assert type(g) is type(comm.allreduce(g))
            out = torch.zeros(6)
            assert ch.allreduce(base, out=out) is out  # out itself, a tensor too
            got.append(out)
        return [np.asarray(g) for g in got]

    for results in run_ranks(2, body):
        for got in results:
            np.testing.assert_array_equal(got, np.arange(6, dtype=np.float32) * 3)


def test_channels_write_a_non_contiguous_out() -> None:
    def body(comm: plait.Communicator) -> np.ndarray:
        out = np.zeros((3, 2)).T
        with Channels(comm, 2) as ch:
            assert ch.allreduce(np.ones((2, 3)), out=out) is out
        return out

    for got in run_ranks(2, body):
        np.testing.assert_array_equal(got, np.full((2, 3), 2.0))


def momentum(lr: float, mu: float):
    def update(p: np.ndarray, g: np.ndarray, state: dict[str, Any]) -> None:
        v = state.setdefault("v", np.zeros_like(p))
        v *= mu
        v += g
        p -= lr * v

    return update


def problem(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((32, 5)).astype(np.float64)
    return x, x @ np.arange(1.0, 6.0) + rng.standard_normal(32) * 0.1


def grads_of(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    w, b = params
    err = x @ w + b - y
    return [x.T @ err / len(y), np.array([err.mean()])]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_sharded_optimizer_trains_like_the_plain_one(size: int) -> None:
    steps, lr, mu = 80, 0.05, 0.9

    def sharded(comm: plait.Communicator) -> list[np.ndarray]:
        params = [np.zeros(5), np.zeros(1)]
        opt = ShardedOptimizer(comm, params, momentum(lr, mu))
        x, y = problem(comm.rank)
        for _ in range(steps):
            opt.step(grads_of(params, x, y))
        assert opt.shard == -(-6 // size)
        return params

    def plain(comm: plait.Communicator) -> list[np.ndarray]:
        params = [np.zeros(5), np.zeros(1)]
        state = [np.zeros(5), np.zeros(1)]
        x, y = problem(comm.rank)
        for _ in range(steps):
            for p, g, v in zip(params, grads_of(params, x, y), state, strict=True):
                avg = comm.allreduce(g, plait.AVG)
                v *= mu
                v += avg
                p -= lr * v
        return params

    got, want = run_ranks(size, sharded), run_ranks(size, plain)
    for r in range(size):
        for a, b in zip(got[r], want[0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
        for a, b in zip(got[r], got[0], strict=True):
            assert a.tobytes() == b.tobytes()  # replicas identical
    assert np.allclose(got[0][0], np.arange(1.0, 6.0), atol=0.5)  # it learned


@pytest.mark.parametrize("size", [1, 2])
def test_sharded_optimizer_updates_non_contiguous_parameters(size: int) -> None:
    """A transposed parameter: ``reshape(-1)`` of it is a copy, which must not take the update."""

    def sgd(p: np.ndarray, g: np.ndarray, state: dict[str, Any]) -> None:
        p -= 0.1 * g

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        params = [np.ones((4, 6)).T, np.ones(3)]
        opt = ShardedOptimizer(comm, params, sgd)
        opt.step([np.ones((6, 4)), np.full(3, 2.0)])
        return params

    for weight, bias in run_ranks(size, body):
        np.testing.assert_allclose(weight, np.full((6, 4), 0.9))
        np.testing.assert_allclose(bias, np.full(3, 0.8))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_sharded_optimizer_keeps_parameters_changed_between_steps(size: int) -> None:
    """A step starts from the parameters as they are, not from the shard the last step left."""

    def sgd(p: np.ndarray, g: np.ndarray, state: dict[str, Any]) -> None:
        p -= 0.5 * g

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        params = [np.zeros((2, 3)), np.zeros(4)]
        opt = ShardedOptimizer(comm, params, sgd)
        opt.step([np.ones((2, 3)), np.ones(4)])  # -0.5 everywhere
        params[0][...] = 10.0  # a checkpoint loaded, on every rank
        params[1][1:3] = 20.0
        opt.step([np.ones((2, 3)), np.ones(4)])
        return params

    for weight, bias in run_ranks(size, body):
        np.testing.assert_array_equal(weight, np.full((2, 3), 9.5))
        np.testing.assert_array_equal(bias, [-1.0, 19.5, 19.5, -1.0])


def test_sharded_optimizer_checks_its_input() -> None:
    def body(comm: plait.Communicator) -> None:
        with pytest.raises(ValueError, match="one dtype"):
            ShardedOptimizer(comm, [np.zeros(2), np.zeros(2, np.float32)], momentum(0.1, 0))
        opt = ShardedOptimizer(comm, [np.zeros(2)], momentum(0.1, 0))
        with pytest.raises(ValueError, match="shape"):
            opt.step([np.zeros(3)])
        with pytest.raises(ValueError, match="gradients for"):
            opt.step([])

    run_ranks(1, body)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_stale_averages_arrive_late_and_in_order(staleness: int) -> None:
    steps = 6

    def body(comm: plait.Communicator) -> list[Any]:
        avg = StaleAverager(comm, staleness)
        got: list[Any] = []
        g = np.zeros(4)
        for t in range(steps):
            g[...] = t * 10 + comm.rank  # the caller reuses its array
            got.append(avg.average(g))
        return got + avg.drain()

    out = run_ranks(3, body)
    for r in range(3):
        assert out[r][:staleness] == [None] * staleness
        due = out[r][staleness:]
        assert len(due) == steps
        for t, a in enumerate(due):
            np.testing.assert_array_equal(a, np.full(4, t * 10 + 1.0))  # mean of ranks 0..2


def test_staleness_and_channels_must_be_counts() -> None:
    """StaleAverager(comm, 1.5) ran as 1, and a string compared with 0 raised Python's
    "'<' not supported"; Channels(comm, "2") likewise."""
    [comm] = memory_communicators(1)
    with comm:
        with pytest.raises(ValueError, match="staleness must be >= 0; got -1"):
            StaleAverager(comm, -1)
        for bad in (1.5, "1", None, True):
            with pytest.raises(TypeError, match="staleness must be an int"):
                StaleAverager(comm, bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="Channels: n must be an int"):
                Channels(comm, bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="n must be >= 1; got 0"):
            Channels(comm, 0)
        with pytest.raises(TypeError, match="got one array: pass"):
            ShardedOptimizer(comm, np.ones(3), lambda p, g, s: None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="at least one parameter"):
            ShardedOptimizer(comm, iter([]), lambda p, g, s: None)


def test_ranks_that_ask_for_different_channels_raise_alike() -> None:
    """Channels(comm, 2 + rank) made 2 splits on one rank and 3 on the other, which waited
    in its last one until the timeout."""

    def body(comm: plait.Communicator) -> float:
        with pytest.raises(ValueError, match=r"different numbers of channels, \[2, 3\]"):
            Channels(comm, 2 + comm.rank)
        return float(comm.allreduce(np.ones(1))[0])

    assert run_ranks(2, body, timeout=10) == [2.0, 2.0]


def test_a_channel_count_refused_on_one_rank_fails_every_rank() -> None:
    """n=0 on rank 0 raised there before the comparison; rank 1 waited in it."""

    def body(comm: plait.Communicator) -> float:
        if comm.rank == 0:
            with pytest.raises(ValueError, match="n must be >= 1; got 0"):
                Channels(comm, 0)
        else:
            with pytest.raises(ValueError, match=r"\[-1, 2\] by rank \(-1: refused there\)"):
                Channels(comm, 2)
        return float(comm.allreduce(np.ones(1))[0])

    assert run_ranks(2, body, timeout=10) == [2.0, 2.0]


@pytest.mark.parametrize("channels", [2, 4])
def test_channels_allreduce_into_an_out_that_overlaps_x(channels: int) -> None:
    """out = buf[2:10] over x = buf[0:8]: a channel's shard written was another's input,
    read meanwhile: wrong sums, different on each rank."""

    def body(comm: plait.Communicator) -> np.ndarray:
        buf = np.arange(10.0) * (comm.rank + 1)
        with Channels(comm, channels) as ch:
            ch.allreduce(buf[0:8], out=buf[2:10])
        return buf[2:]

    for got in run_ranks(2, body):
        np.testing.assert_array_equal(got, np.arange(8.0) * 3)


def test_sharded_optimizer_refuses_shapes_that_differ_between_ranks() -> None:
    """5 elements on rank 0 and 6 on rank 1 pad to the same shard of 3: the replicas went
    apart without an error."""

    def body(comm: plait.Communicator) -> float:
        w = np.ones(5 + comm.rank)
        opt = ShardedOptimizer(comm, [w], lambda p, g, s: p.__isub__(0.5 * g))
        with pytest.raises(ValueError, match=r"shapes of rank\(s\) \[1\] differ"):
            opt.step([np.ones(5 + comm.rank)])
        assert (w == 1).all()  # nothing was updated
        return float(comm.allreduce(np.ones(1))[0])

    assert run_ranks(2, body, timeout=10) == [2.0, 2.0]


def test_sharded_optimizer_follows_torch_parameters_whose_data_was_replaced() -> None:
    """``p.data = ...`` (vector_to_parameters, a checkpoint loader) left the optimizer
    reading and writing the old memory: the parameters never moved again."""
    torch = pytest.importorskip("torch")

    def body(comm: plait.Communicator) -> list[float]:
        torch.manual_seed(0)
        m = torch.nn.Linear(2, 1)
        opt = ShardedOptimizer(comm, list(m.parameters()), lambda p, g, s: p.__isub__(0.5 * g))
        torch.nn.utils.vector_to_parameters(torch.zeros(3), m.parameters())
        opt.step([torch.ones(1, 2), torch.ones(1)])
        return torch.nn.utils.parameters_to_vector(m.parameters()).tolist()

    assert run_ranks(2, body) == [[-0.5, -0.5, -0.5]] * 2


@pytest.mark.parametrize("size", [1, 3])
def test_sharded_optimizer_updates_torch_parameters_in_place(size: int) -> None:
    """``nn.Parameter``s and their ``.grad``s, as a torch training loop has them."""
    torch = pytest.importorskip("torch")

    def sgd(p: np.ndarray, g: np.ndarray, state: dict[str, Any]) -> None:
        p -= 0.5 * g

    def body(comm: plait.Communicator) -> list[Any]:
        weight = torch.nn.Parameter(torch.ones(3, 2))
        bias = torch.nn.Parameter(torch.zeros(5))
        opt = ShardedOptimizer(comm, [weight, bias], sgd)
        opt.step([torch.full((3, 2), float(comm.rank)), torch.ones(5)])
        return [weight, bias]

    mean = sum(range(size)) / size
    for weight, bias in run_ranks(size, body):
        assert isinstance(weight, torch.nn.Parameter)
        assert weight.requires_grad
        torch.testing.assert_close(weight.data, torch.full((3, 2), 1.0 - 0.5 * mean))
        torch.testing.assert_close(bias.data, torch.full((5,), -0.5))


def test_sharded_optimizer_refuses_parameters_it_cannot_update() -> None:
    def body(comm: plait.Communicator) -> None:
        frozen = np.zeros(3)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match=r"params\[1\] is read-only"):
            ShardedOptimizer(comm, [np.zeros(3), frozen], momentum(0.1, 0))
        with pytest.raises(TypeError, match=r"params\[0\]"):
            ShardedOptimizer(comm, [[1.0, 2.0]], momentum(0.1, 0))  # a list: never written

    run_ranks(1, body)


def test_stale_averages_of_bfloat16_tensors_come_back_as_tensors() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")

    def body(comm: plait.Communicator) -> list[Any]:
        avg = StaleAverager(comm, 1)
        g = torch.zeros(4, dtype=torch.bfloat16)
        got = []
        for t in range(3):
            g.fill_(2.0 * t + 2.0 * comm.rank)  # the caller reuses its tensor
            got.append(avg.average(g))
        return got + avg.drain()

    for got in run_ranks(2, body):
        assert got[0] is None
        for t, a in enumerate(got[1:]):
            assert isinstance(a, torch.Tensor)
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a, torch.full((4,), 2.0 * t + 1.0, dtype=torch.bfloat16))
