"""Gradient bucketing: fused, overlapped allreduce of many gradients, checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest

import plait
from plait.bucketing import Bucketer, attach
from plait.testing import run_ranks

SHAPES = [(7, 5), (5,), (64, 33), (33,), (3,), (1000,), (2, 2, 2)]


def grads_of(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("bucket_bytes", [1, 300, 4096, 1 << 20])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_bucketed_average_equals_numpy(size: int, bucket_bytes: int) -> None:
    steps = 3

    def body(comm: plait.Communicator) -> list[list[np.ndarray]]:
        grads = [np.empty(s, np.float32) for s in SHAPES]
        b = Bucketer(comm, grads, bucket_bytes=bucket_bytes)
        results = []
        for step in range(steps):
            mine = grads_of(comm.rank, step)
            for i in reversed(range(len(SHAPES))):
                grads[i][...] = mine[i]
                b.ready(i)
            b.wait()
            results.append([g.copy() for g in grads])
        return results

    out = run_ranks(size, body)
    for step in range(steps):
        per_rank = [grads_of(r, step) for r in range(size)]
        for i in range(len(SHAPES)):
            want = sum(per_rank[r][i] for r in range(size)) / size
            np.testing.assert_allclose(out[0][step][i], want, rtol=1e-6, atol=1e-7)
            for r in range(1, size):  # bit-identical on every rank
                assert out[r][step][i].tobytes() == out[0][step][i].tobytes()


def test_buckets_follow_backward_order_and_size() -> None:
    def body(comm: plait.Communicator) -> list[list[int]]:
        layout = [((100,), np.float32)] * 5  # 400 bytes each
        return Bucketer(comm, layout, bucket_bytes=800).bucket_members()

    assert run_ranks(1, body)[0] == [[4, 3], [2, 1], [0]]


def test_gradients_ready_out_of_order_start_buckets_in_order() -> None:
    """Rank 1 finishes its gradients in another order: buckets still start alike."""

    def body(comm: plait.Communicator) -> np.ndarray:
        grads = [np.full(10, float(comm.rank + i), np.float32) for i in range(4)]
        b = Bucketer(comm, grads, bucket_bytes=40, op=plait.SUM)
        order = [3, 2, 1, 0] if comm.rank == 0 else [0, 2, 1, 3]
        for i in order:
            b.ready(i)
        b.wait()
        return np.stack(grads)

    a, c = run_ranks(2, body)
    want = np.stack([np.full(10, 2.0 * i + 1, np.float32) for i in range(4)])
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(c, want)


def test_dtypes_are_never_mixed_in_a_bucket() -> None:
    def body(comm: plait.Communicator) -> list[list[int]]:
        grads = [np.ones(4, np.float32), np.ones(4, np.float64), np.ones(4, np.float32)]
        b = Bucketer(comm, grads)
        for i in (2, 1, 0):
            b.ready(i)
        b.wait()
        assert all(np.all(g == 1) for g in grads)
        return b.bucket_members()

    assert run_ranks(2, body)[0] == [[1], [2, 0]]  # float64 completes first


# -- one open bucket per dtype (Note [a bucket per dtype] in plait.bucketing) ------------------
MIXED = [np.float16 if i % 2 == 0 else np.float32 for i in range(20)]  # 100 elements each


def mixed_grads(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    return [rng.standard_normal(100).astype(d) for d in MIXED]


@pytest.mark.parametrize("size", [2, 3])
def test_interleaved_dtypes_share_a_bucket_per_dtype(size: int) -> None:
    """float16 and float32 gradients in turn (6000 bytes) made 20 buckets, one allreduce per
    gradient: the open bucket was closed at every change of dtype."""

    def body(comm: plait.Communicator) -> tuple[int, list[list[int]], list, list]:
        grads = [np.empty(100, d) for d in MIXED]
        b = Bucketer(comm, grads)
        got, alone = [], []
        for step in range(3):
            mine = mixed_grads(comm.rank, step)
            for i in reversed(range(len(grads))):
                grads[i][...] = mine[i]
                b.ready(i)
            b.wait()
            got.append([g.copy() for g in grads])
            alone.append([comm.allreduce(g, plait.AVG) for g in mine])
        return b.num_buckets, b.bucket_members(), got, alone

    out = run_ranks(size, body)
    floats32, floats16 = list(range(19, 0, -2)), list(range(18, -1, -2))
    for count, members, got, alone in out:
        assert count == 2
        assert members == [floats32, floats16]  # in backward order; float16's completes last
        for step in range(3):
            for i in range(20):
                assert got[step][i].dtype == MIXED[i]
                # bit for bit the average of the gradient's own allreduce, and on every rank
                assert got[step][i].tobytes() == alone[step][i].tobytes(), (step, i)
                assert got[step][i].tobytes() == out[0][2][step][i].tobytes(), (step, i)


def test_each_dtype_fills_buckets_of_its_own_up_to_bucket_bytes() -> None:
    def body(comm: plait.Communicator) -> list[list[int]]:
        # float32 gradients of 400 bytes and float16 ones of 200, in turn; 800-byte buckets
        layout = [((100,), np.float32 if i % 2 else np.float16) for i in range(10)]
        b = Bucketer(comm, layout, bucket_bytes=800)
        arrays = [np.full(s, comm.rank + 1, d) for s, d in layout]
        for i in (9, 8, 7, 6, 5, 4, 3, 2, 1, 0):
            b.ready(i, arrays[i])
        b.wait()
        assert all(np.all(a == 1.5) for a in arrays)
        return b.bucket_members()

    # float32: [9, 7], [5, 3], [1]; float16: [8, 6, 4, 2], [0]; started as they complete
    want = [[9, 7], [5, 3], [8, 6, 4, 2], [1], [0]]
    assert run_ranks(2, body) == [want, want]


def test_the_buckets_are_those_of_the_order_given_never_of_when_gradients_come() -> None:
    """Each rank marks the interleaved gradients ready in its own order: the buckets are the
    layout's alone (those of ``order``), so every rank starts the same allreduces."""

    def body(comm: plait.Communicator) -> tuple[list[list[int]], list[np.ndarray]]:
        grads = [np.full(100, comm.rank + i, d) for i, d in enumerate(MIXED)]
        b = Bucketer(comm, grads, bucket_bytes=1000, order=list(range(20)), op=plait.SUM)
        marks = list(range(20)) if comm.rank == 0 else [*range(1, 20, 2), *range(0, 20, 2)]
        for i in marks:
            b.ready(i)
        b.wait()
        return b.bucket_members(), grads

    (m0, g0), (m1, g1) = run_ranks(2, body)
    floats16 = [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18]]  # 1000 bytes each; float32: 800
    assert m0 == m1 == [[1, 3], [5, 7], floats16[0], [9, 11], [13, 15], floats16[1], [17, 19]]
    for i in range(20):
        np.testing.assert_array_equal(g0[i], np.full(100, 2 * i + 1, MIXED[i]))
        assert g0[i].tobytes() == g1[i].tobytes()


def test_misuse_is_refused() -> None:
    def body(comm: plait.Communicator) -> None:
        grads = [np.ones(3, np.float32), np.ones(2, np.float32)]
        b = Bucketer(comm, grads)
        b.ready(1)
        with pytest.raises(ValueError, match="already marked"):
            b.ready(1)
        with pytest.raises(ValueError, match="out of range"):
            b.ready(5)
        with pytest.raises(ValueError, match=r"gradients \[0\] were not marked"):
            b.wait()
        shaped = Bucketer(comm, [((3,), np.float32)])
        with pytest.raises(ValueError, match="pass its array"):
            shaped.ready(0)
        with pytest.raises(ValueError, match="expected"):
            shaped.ready(0, np.ones(4, np.float32))
        with pytest.raises(ValueError, match="at least one"):
            Bucketer(comm, [])
        with pytest.raises(ValueError, match="order"):
            Bucketer(comm, grads, order=[0, 0])

    run_ranks(1, body)


def test_torch_module_gradients_are_averaged_during_backward() -> None:
    torch = pytest.importorskip("torch")
    import copy

    torch.manual_seed(0)  # one model, copied per rank (torch's RNG is shared by threads)
    base = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    inputs = [
        torch.from_numpy(np.random.default_rng(r).standard_normal((8, 6))).float() for r in range(3)
    ]

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        model = copy.deepcopy(base)
        finish = attach(model, comm, bucket_bytes=256)
        for _ in range(2):
            model.zero_grad()
            model(inputs[comm.rank]).square().sum().backward()
            finish()
        return [p.grad.numpy().copy() for p in model.parameters()]

    grads = []
    for r in range(3):
        model = copy.deepcopy(base)
        model(inputs[r]).square().sum().backward()
        grads.append([p.grad.numpy().copy() for p in model.parameters()])
    want = [sum(g[i] for g in grads) / 3 for i in range(len(grads[0]))]

    out = run_ranks(3, body)
    for got, w in zip(out[0], want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    for r in (1, 2):
        for a, b in zip(out[0], out[r], strict=True):
            assert a.tobytes() == b.tobytes()


# -- where the averages are written (Note [writing the averages back] in plait.bucketing) ------
def test_a_non_contiguous_gradient_gets_the_average() -> None:
    """A transposed gradient: ``reshape(-1)`` of it is a copy, which must not take the result."""

    def body(comm: plait.Communicator) -> np.ndarray:
        g = np.zeros((4, 6), np.float32).T  # built from the array itself
        b = Bucketer(comm, [g, np.zeros(3, np.float32)])
        g[...] = np.arange(24, dtype=np.float32).reshape(6, 4) * (comm.rank + 1)
        b.ready(1)
        b.ready(0)
        b.wait()
        return g

    want = np.arange(24, dtype=np.float32).reshape(6, 4) * 1.5
    for got in run_ranks(2, body):
        np.testing.assert_array_equal(got, want)


def test_a_non_contiguous_tensor_given_to_ready_gets_the_average() -> None:
    torch = pytest.importorskip("torch")

    def body(comm: plait.Communicator) -> np.ndarray:
        b = Bucketer(comm, [((6, 4), np.float32)])
        t = torch.zeros(4, 6).T
        t[...] = float(comm.rank + 1)
        b.ready(0, t)
        b.wait()
        return t.numpy().copy()

    for got in run_ranks(2, body):
        np.testing.assert_array_equal(got, np.full((6, 4), 1.5, np.float32))


def test_attach_averages_a_channels_last_convolution() -> None:
    """A channels-last Conv2d's ``weight.grad`` is not contiguous: its average must land in it."""
    torch = pytest.importorskip("torch")
    import copy

    torch.manual_seed(0)
    base = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    inputs = [
        torch.from_numpy(np.random.default_rng(r).standard_normal((2, 3, 5, 5)))
        .float()
        .to(memory_format=torch.channels_last)
        for r in range(2)
    ]

    def grads(model: torch.nn.Module) -> list[np.ndarray]:
        return [p.grad.numpy().copy() for p in model.parameters()]

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        model = copy.deepcopy(base)
        finish = attach(model, comm)
        model(inputs[comm.rank]).square().sum().backward()
        assert not model.weight.grad.is_contiguous()  # what the test is about
        finish()
        return grads(model)

    local = []
    for r in range(2):
        model = copy.deepcopy(base)
        model(inputs[r]).square().sum().backward()
        local.append(grads(model))
    for got in run_ranks(2, body):
        for i, g in enumerate(got):
            np.testing.assert_allclose(g, (local[0][i] + local[1][i]) / 2, rtol=1e-5, atol=1e-5)


def test_bfloat16_gradients_are_read_as_the_communicator_reads_them() -> None:
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")

    def body(comm: plait.Communicator) -> tuple[list[float], list[np.ndarray]]:
        b = Bucketer(comm, [((3,), ml_dtypes.bfloat16)])
        t = torch.full((3,), float(comm.rank + 1), dtype=torch.bfloat16)
        b.ready(0, t)
        b.wait()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        finish = attach(model, comm)
        model(torch.full((1, 4), float(comm.rank + 1), dtype=torch.bfloat16)).sum().backward()
        finish()
        return t.float().tolist(), [p.grad.float().numpy() for p in model.parameters()]

    (a, ga), (c, gc) = run_ranks(2, body)
    assert a == c == [1.5, 1.5, 1.5]
    np.testing.assert_array_equal(ga[0], np.full((2, 4), 1.5, np.float32))  # mean of 1 and 2
    np.testing.assert_array_equal(ga[1], np.ones(2, np.float32))
    for x, y in zip(ga, gc, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_jax_array_is_refused_at_ready_before_any_bucket_starts() -> None:
    """JAX never changes an array in place: refused when given, not after the allreduce ran."""
    jnp = pytest.importorskip("jax.numpy")

    def body(comm: plait.Communicator) -> None:
        shaped = Bucketer(comm, [((3,), np.float32)])
        with pytest.raises(TypeError, match=r"gradient 0 is a jax\.Array, which cannot be changed"):
            shaped.ready(0, jnp.ones(3, jnp.float32))
        with pytest.raises(TypeError, match=r"gradient 0 is a jax\.Array"):
            Bucketer(comm, [jnp.ones(3, jnp.float32)])
        g = np.full(3, comm.rank + 1.0, np.float32)  # nothing was started: the step goes on
        shaped.ready(0, g)
        shaped.wait()
        np.testing.assert_array_equal(g, np.full(3, 1.5, np.float32))

    run_ranks(2, body)


def test_what_cannot_take_the_average_in_place_is_refused_before_any_bucket_starts() -> None:
    def body(comm: plait.Communicator) -> None:
        shaped = Bucketer(comm, [((3,), np.float32)])
        with pytest.raises(ValueError, match="gradient 0 is read-only"):
            shaped.ready(0, np.broadcast_to(np.float32(1), (3,)))
        with pytest.raises(ValueError, match="share memory"):
            shaped.ready(0, np.lib.stride_tricks.as_strided(np.ones(1, np.float32), (3,), (0,)))
        with pytest.raises(TypeError, match="only the copy written"):
            shaped.ready(0, [1.0, 2.0, 3.0])
        with pytest.raises(TypeError, match="only the copy written"):
            Bucketer(comm, [[1.0, 2.0, 3.0]])
        # Nothing was started: the Bucketer still serves a step.
        g = np.full(3, comm.rank + 1.0, np.float32)
        shaped.ready(0, g)
        shaped.wait()
        np.testing.assert_array_equal(g, np.full(3, 1.5, np.float32))

    run_ranks(2, body)


def test_a_gradient_in_device_memory_gets_the_average_copied_back() -> None:
    from fake_device import FakeDevice, FakeDeviceArray

    def body(comm: plait.Communicator) -> tuple[np.ndarray, np.ndarray]:
        dev = FakeDevice()
        given = FakeDeviceArray(np.zeros((2, 3), np.float32), dev)  # read again at ready()
        later = FakeDeviceArray(np.zeros(4, np.float32), dev)
        b = Bucketer(comm, [given, ((4,), np.float32)])
        given.launch(np.full((2, 3), comm.rank + 1.0))  # this step's gradient, still queued
        later.launch(np.full(4, 10.0 * (comm.rank + 1)))
        b.ready(1, later)
        b.ready(0)
        b.wait()
        return given.held(), later.held()

    for g, h in run_ranks(2, body):
        np.testing.assert_array_equal(g, np.full((2, 3), 1.5, np.float32))
        np.testing.assert_array_equal(h, np.full(4, 15.0, np.float32))


def test_a_wait_that_times_out_leaves_the_step_to_a_later_wait() -> None:
    """wait(timeout) reset the Bucketer while the allreduce went on: a retried wait said the
    gradients were never marked ready, this rank's gradient was never averaged, and the next
    step's ready() wrote into the buffer the allreduce was still reducing (125.5, not 150)."""
    import threading

    late = threading.Event()

    def body(comm: plait.Communicator) -> list[float]:
        g = [np.zeros(4)]
        b = Bucketer(comm, g)
        seen = []
        for step, val in enumerate((1.0, 100.0)):
            g[0][...] = val * (comm.rank + 1)
            if comm.rank == 1 and step == 0:
                assert late.wait(30)  # rank 0's wait has timed out
            b.ready(0)
            if comm.rank == 0 and step == 0:
                with pytest.raises(plait.CommTimeout):
                    b.wait(timeout=0.2)
                with pytest.raises(ValueError, match="the step goes on until a wait"):
                    b.ready(0)
                late.set()
            b.wait()
            seen.append(float(g[0][0]))
        return seen

    assert run_ranks(2, body) == [[1.5, 150.0], [1.5, 150.0]]


def test_compression_refuses_gradients_it_cannot_compress_when_built() -> None:
    """An int64 gradient with compression was accepted; ready() of a float gradient then
    raised the int64 gradient's TypeError, and every wait() a bare AssertionError."""
    from plait.compression import FP16

    def body(comm: plait.Communicator) -> None:
        grads = [np.ones(4, np.float32), np.ones(3, np.int64)]
        with pytest.raises(TypeError, match="gradient 1 is int64; compression needs float16"):
            Bucketer(comm, grads, compression=FP16(), op=plait.SUM)
        with pytest.raises(ValueError, match=r"compression supports plait\.SUM and plait\.AVG"):
            Bucketer(comm, grads[:1], compression=FP16(), op=plait.MAX)

    run_ranks(2, body)


def test_shape_and_dtype_pairs_take_torch_dtypes() -> None:
    """(shape, torch.float32) raised "Cannot interpret 'torch.float32' as a data type"."""
    torch = pytest.importorskip("torch", reason="torch dtypes need torch")

    def body(comm: plait.Communicator) -> list[float]:
        b = Bucketer(comm, [((2,), torch.float32), ((3,), torch.bfloat16)])
        a = torch.full((2,), float(comm.rank + 1))
        c = torch.full((3,), float(comm.rank + 1), dtype=torch.bfloat16)
        b.ready(1, c)
        b.ready(0, a)
        b.wait()
        return [float(a[0]), float(c[0])]

    assert run_ranks(2, body) == [[1.5, 1.5], [1.5, 1.5]]
    with pytest.raises(TypeError, match="'f32' is not a dtype"):
        Bucketer(None, [((2,), "f32")])
