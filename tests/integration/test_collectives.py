"""Every collective x algorithm x op x dtype family x world size, against the numpy reference.

Threads play the ranks over the in-process transport. Each test runs one
(algorithm, world size) with many calls in a row on the same communicator:
counts 0, 1, odd and 2-D shapes, several roots, every op on the dtypes it
supports. It asserts exact agreement with :func:`plait.testing.reference`,
bit-identical results on every rank, and that inputs are never modified.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

import plait
from cases import AFFINE, Case, all_dtypes, bits, op_dtypes, same, values
from plait.algos._registry import COLLECTIVES, REDUCING, AlgorithmSpec
from plait.runtime import executor, stall, waits
from plait.testing import reference, run_ranks

# Algorithms that need aggregating switches run only in the simulator (tests/sim).
SPECS = [s for c in COLLECTIVES for s in plait._algorithms.specs(c) if not s.needs_fabric]
#: World sizes checked against the reference; the quick loop (``-m "not slow"``) runs 1, 2, 3.
SIZES = [
    p if p in (1, 2, 3) else pytest.param(p, marks=pytest.mark.slow)
    for p in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17]
]
# Results that every rank holds a copy of: must be bit-identical everywhere.
REPLICATED = {"allreduce", "allgather", "broadcast"}


def _caller(spec: AlgorithmSpec, op: plait.Op | None, root: int) -> Any:
    c, name = spec.collective, spec.name
    if c == "allreduce":
        return lambda comm, x: comm.allreduce(x, op, algorithm=name)
    if c == "reduce":
        return lambda comm, x: comm.reduce(x, root, op, algorithm=name)
    if c == "reduce_scatter":
        return lambda comm, x: comm.reduce_scatter(x, op, algorithm=name)
    if c == "broadcast":
        return lambda comm, x: comm.broadcast(x.copy(), root, algorithm=name)
    if c == "allgather":
        return lambda comm, x: comm.allgather(x, algorithm=name)
    if c == "alltoall":
        return lambda comm, x: comm.alltoall(x, algorithm=name)
    if c == "gather":
        return lambda comm, x: comm.gather(x, root, algorithm=name)
    if c == "scatter":
        return lambda comm, x: comm.scatter(x, root, algorithm=name)
    return lambda comm, x: comm.barrier(algorithm=name)


def _shapes(collective: str, size: int, big: bool) -> list[tuple[int, ...]]:
    per_rank_rows = collective in ("reduce_scatter", "alltoall", "scatter")
    if big:
        return [(size * 3,)] if per_rank_rows else [(size + 3,)]
    if per_rank_rows:
        return [(0,), (size,), (size * 3,), (size * 2, 3)]
    return [(0,), (1,), (size + 1,), (37,), (3, 5)]


def build_cases(spec: AlgorithmSpec, size: int, *, big: bool = False) -> list[Case]:
    c = spec.collective
    if c == "barrier":
        return [Case("barrier", lambda r: np.empty(0), _caller(spec, None, 0), None, 0)] * 3
    roots = sorted({0, size - 1}) if c in ("reduce", "broadcast", "gather", "scatter") else [0]
    pairs: list[tuple[plait.Op | None, np.dtype]]
    if c in REDUCING and big:
        pairs = [(plait.SUM, np.dtype(np.float32)), (plait.BXOR, np.dtype(np.int64))]
        if spec.supports(commutative=False):
            pairs.append((AFFINE, np.dtype(np.complex128)))
    elif c in REDUCING:
        pairs = [(op, dt) for op, dt in op_dtypes() if spec.supports(commutative=op.commutative)]
    elif big:
        pairs = [(None, np.dtype(np.float32)), (None, np.dtype(np.uint8))]
    else:
        pairs = [(None, dt) for dt in all_dtypes()]
    # Rotate the shapes and roots over the pairs to keep the matrix small while every pair
    # sees an empty, a tiny and a large call somewhere: half of them up to 9 ranks, a
    # quarter at 16 and 17 (the sizes below have given every pair every shape already).
    every = 2 if size <= 9 else 4
    cases = []
    for i, (op, dtype) in enumerate(pairs):
        for j, shape in enumerate(_shapes(c, size, big)):
            if not big and (i + j) % every and len(pairs) > 4:
                continue
            root = roots[(i + j) % len(roots)]
            # A stable seed (str hashes differ between processes): ranks in separate
            # processes must regenerate each other's inputs.
            seed = zlib.crc32(f"{spec.collective}/{spec.name}/{size}/{i}/{j}".encode())

            def make(
                r: int,
                dtype: np.dtype = dtype,
                shape: tuple = shape,
                op: Any = op,
                seed: int = seed,
            ) -> np.ndarray:
                rng = np.random.default_rng([seed, r])
                return values(rng, dtype, op, shape, size)

            cases.append(
                Case(f"{op!r} {dtype} {shape} root={root}", make, _caller(spec, op, root), op, root)
            )
    return cases


def check(
    spec: AlgorithmSpec,
    size: int,
    cases: list[Case],
    *,
    lockstep: bool = False,
    timeout: float = 30.0,
) -> None:
    def body(comm: plait.Communicator) -> list[Any]:
        results = []
        for case in cases:
            x = case.make(comm.rank)
            before = x.copy()
            results.append(case.call(comm, x))
            assert np.array_equal(x, before), f"{case.name}: input modified on rank {comm.rank}"
        return results

    results = run_ranks(size, body, lockstep=lockstep, timeout=timeout)
    for i, case in enumerate(cases):
        inputs = [case.make(r) for r in range(size)]
        want = reference(spec.collective, inputs, op=case.op, root=case.root)
        for r in range(size):
            got = results[r][i]
            assert same(got, want[r]), (
                f"{spec.collective}/{spec.name} size={size} {case.name} rank {r}:\n"
                f"got  {got!r}\nwant {want[r]!r}"
            )
        if spec.collective in REPLICATED:
            first = bits(results[0][i])
            assert all(bits(results[r][i]) == first for r in range(size)), case.name


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.collective}-{s.name}")
def test_matches_reference(spec: AlgorithmSpec, size: int) -> None:
    check(spec, size, build_cases(spec, size))


#: At 64 and 100 ranks the one-sided algorithms share one code path (copy in, post, read the
#: windows): allreduce's two and alltoall's stand for them (the others run up to 17 ranks).
MANY_RANK_SPECS = [
    s for s in SPECS if not s.needs_window or s.collective in ("allreduce", "alltoall")
]


#: The algorithms whose steps depend on the largest power of two in p (halving, doubling,
#: trees, Bruck's shifts): 64 ranks as well as 100. The others cut the vector in p blocks
#: and run the same code at every p, so 100 ranks stand for both.
POW2_SHAPED = {
    "binomial",
    "bruck",
    "dissemination",
    "double_binary_tree",
    "rabenseifner",
    "recursive_doubling",
    "recursive_halving",
    "scatter_allgather",
    "swing",
}


MANY_RANKS = [
    pytest.param(spec, p, marks=pytest.mark.slow, id=f"{spec.collective}-{spec.name}-{p}")
    for spec in MANY_RANK_SPECS
    for p in (64, 100)
    if p == 100 or spec.name in POW2_SHAPED
]


@pytest.mark.parametrize(("spec", "size"), MANY_RANKS)
def test_matches_reference_many_ranks(
    spec: AlgorithmSpec, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hundred threads take over a second for a call, so every rank would probe its 99 peers
    # (Note [stall probes]): some 10,000 more messages a call, which doubles the test's time.
    # One algorithm keeps the probes, as a check that real traffic never trips them; the
    # probes themselves are tested in test_stall_probes.py.
    if (spec.collective, spec.name) != ("allreduce", "ring"):
        monkeypatch.setattr(waits, "PROBE_SECONDS", 3600.0)  # message calls
        monkeypatch.setattr(stall, "PROBE_SECONDS", 3600.0)  # one-sided calls' waits
    # A call of a hundred threads on two loaded cores can take tens of seconds: this test is
    # about results, so its calls get the test's own limit rather than run_ranks' 30 s.
    check(spec, size, build_cases(spec, size, big=True), timeout=110.0)


@pytest.mark.parametrize("size", [5, 8])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.collective}-{s.name}")
def test_lockstep_transport(spec: AlgorithmSpec, size: int) -> None:
    """Zero-buffer sends: a schedule that relied on buffering would deadlock here."""
    check(spec, size, build_cases(spec, size, big=True), lockstep=True)


@pytest.mark.parametrize("size", [3, pytest.param(5, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "spec", [s for s in SPECS if not s.needs_window], ids=lambda s: f"{s.collective}-{s.name}"
)
def test_the_dataflow_alone_matches_reference(
    spec: AlgorithmSpec, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small calls take a straight-line order where one is safe (plait.schedule.straight);
    the dataflow that runs every other schedule gives the same results on them too."""
    monkeypatch.setattr(executor, "line_of", lambda schedule, itemsize: None)
    check(spec, size, build_cases(spec, size))


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("algorithm", ["arena_oneshot", "arena_leader", "arena", "ring", "auto"])
def test_complex_products_agree_bitwise_whatever_the_path(dtype: Any, algorithm: str) -> None:
    """Note [complex products]: numpy's complex multiply of one element rounds otherwise when
    ``out`` is an input, so a one-shot fold gave rank 0 (in place) other bits than its
    peers in 4 of 10 draws, and a last piece of one element other bits than the reference."""
    size = 3
    draws = [
        [np.random.default_rng(100 * s + r).standard_normal((n, 2)) for r in range(size)]
        for s in range(8)
        for n in (1, 2, 65)
    ]

    def body(comm: plait.Communicator) -> list[bytes]:
        got = []
        for draw in draws:
            x = draw[comm.rank].astype(np.dtype(dtype).char.lower()).view(dtype).ravel()
            if comm.rank == 0:  # in place here, not on the others
                comm.allreduce(x, plait.PROD, out=x, algorithm=algorithm)
                got.append(x.tobytes())
            else:
                got.append(comm.allreduce(x, plait.PROD, algorithm=algorithm).tobytes())
        return got

    for window in (1 << 20, 1024):  # 1 KiB: 65 elements come in pieces, the last of one
        ranks = run_ranks(size, body, window=window)
        for i, draw in enumerate(draws):
            xs = [d.astype(np.dtype(dtype).char.lower()).view(dtype).ravel() for d in draw]
            [want_array, *_] = reference("allreduce", xs, op=plait.PROD)
            assert want_array is not None
            want = want_array.tobytes()
            got = {ranks[r][i] for r in range(size)}
            assert len(got) == 1, (window, i)  # every rank's bits alike
            if algorithm.startswith("arena"):  # these fold in rank order, as the reference
                assert got == {want}, (window, i)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("algorithm", plait.algorithms("allreduce"))
def test_nans_of_different_signs_agree_bitwise(algorithm: str, size: int) -> None:
    """Note [one-element folds]: numpy's loop for one element gives the NaN of the operand
    ``out`` is not, so recursive doubling's partners (each folding into its own buffer)
    and a one-shot fold in place gave the ranks NaNs of different signs."""
    cases = [(dtype, n) for dtype in (np.float32, np.float64, np.complex128) for n in (1, 2, 17)]

    def body(comm: plait.Communicator) -> list[bytes] | None:
        got = []
        for dtype, n in cases:
            x = np.full(n, np.nan, dtype)
            if comm.rank % 2 == 0:
                x = -x  # x86's NaN from inf - inf has its sign bit set; np.nan has not
            try:
                if comm.rank == 0:  # in place here, not on the others
                    comm.allreduce(x, plait.SUM, out=x, algorithm=algorithm)
                    got.append(x.tobytes())
                else:
                    got.append(comm.allreduce(x, plait.SUM, algorithm=algorithm).tobytes())
            except plait.UnsupportedError:  # an algorithm that needs hosts, or a network
                return None
        return got

    ranks = run_ranks(size, body)
    if ranks[0] is None:
        pytest.skip(f"{algorithm} does not run on {size} threads of one process")
    for i, case in enumerate(cases):
        assert len({ranks[r][i] for r in range(size)}) == 1, case


def test_complex_multiply_is_the_textbook_formula_on_every_path() -> None:
    rng = np.random.default_rng(7)
    empty = np.zeros(0, np.complex64)
    assert plait.ops.complex_multiply(empty, empty, out=empty) is empty  # 0 elements
    for n in (1, 2, 3, 8, 33, 20_000):  # and more than one chunk
        a = rng.standard_normal(2 * n).view(np.complex128)
        b = rng.standard_normal(2 * n).view(np.complex128)
        re = a.real * b.real - a.imag * b.imag
        im = a.real * b.imag + a.imag * b.real
        want = (re + 0j).astype(np.complex128)
        want.imag = im
        for out in ("new", "apart", "a", "b"):
            x, y = a.copy(), b.copy()
            dst = {"new": None, "apart": np.empty_like(a), "a": x, "b": y}[out]
            got = plait.ops.complex_multiply(x, y, out=dst)  # type: ignore[arg-type]
            assert got.tobytes() == want.tobytes(), (n, out)
