"""PowerSGD: a rank-r approximation by one step of power iteration (Vogels et al. 2019).

A gradient viewed as an ``n x m`` matrix ``M`` (axis 0 by the rest) is sent as
two thin matrices, ``P`` (``n x r``) and ``Q`` (``m x r``). Both are linear in
``M``, so they are summed by plain allreduces, and the result is identical bit
for bit on every rank. Per call, as Algorithm 1 of the paper::

    M   = x.reshape(n, m) + e            (e: this rank's error, 0 at first)
    P   = M @ Q                          (Q: identical on every rank)
    P   = allreduce(P)                   # 1st exchange, n*r numbers
    P^  = orthogonalize(P)               (Gram-Schmidt on the columns)
    Qi  = M.T @ P^
    Q   = allreduce(Qi)                  # 2nd exchange, m*r numbers (/ size for AVG)
    out = P^ @ Q.T                       (every rank, the same numbers)
    e   = M - P^ @ Qi.T                  (error feedback: what this rank's part lost)
    keep Q for the next call             (warm start)

The error is the rank's own compression residual (Algorithm 2, "memorize local
errors"); summed over ranks it equals the total residual ``sum(M) - out``.
Warm start reuses the previous call's ``Q`` (the allreduced one, so still
identical everywhere), which makes the single power-iteration step track the
gradient's top singular vectors across steps. The first ``Q`` is standard
normal from ``np.random.default_rng([seed, n, m, r])``, the same on every
rank; without warm start every call draws a fresh one from a generator seeded
with ``seed`` (the same draws on every rank, as the ranks call in the same order).

``orthogonalize`` and the product ``P^ @ Q.T`` are written with element-wise
numpy operations and sums (never BLAS, whose blocking may vary between
machines), so every rank computes the same bits from the same inputs.

Note [non-finite state]
    One inf or NaN in a gradient makes ``P``, and through the allreduce every
    rank's ``P``, ``Q`` and error, NaN; kept as they are, every later step of
    that tensor would be NaN. The step that holds it returns NaN or inf, as a
    plain allreduce would, but the state keeps only finite numbers: error
    entries that are not finite are reset to 0, and a ``Q`` with any entry
    that is not finite is replaced by the first ``Q`` (the seeded draw). ``Q``
    is allreduced, so every rank sees the same non-finite entries and makes
    the same choice: it stays identical everywhere. The next finite step
    recovers. The arithmetic on non-finite values raises no warning of
    numpy's: it is expected here.

Fallback: tensors with fewer than two dimensions, and matrices where
``(n + m) * r * min_compression_rate >= n * m`` (torch's rule), go through the
plain allreduce, uncompressed and without state: one allreduce, a SUM in
``x``'s dtype or, for ``AVG``, a SUM in the working precision divided by the
number of ranks there before the cast back, as every compressor averages (the
communicator's AVG sums in ``x``'s dtype, where a float16 sum overflows while
the mean would not; float16 data then sends float32 numbers).

Bytes one rank sends per call: those of allreduces of ``n*r`` and ``m*r``
elements, against one of ``n*m``: a ratio of ``(n + m) r / (n m)`` when the
three allreduces use the same algorithm.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.compression.base import Compressor, check_seed, work_dtype
from plait.ops import SUM

if TYPE_CHECKING:
    from plait.communicator import Communicator

__all__ = ["PowerSGD", "low_rank_product", "orthogonalize"]


def orthogonalize(p: np.ndarray, epsilon: float = 0.0) -> np.ndarray:
    """Orthonormalize the columns of ``p`` in place (modified Gram-Schmidt); returns ``p``.

    A column that is (numerically) zero stays zero instead of becoming NaN;
    ``epsilon`` is added to every norm before dividing, as in torch's hook.
    Element-wise numpy operations and sums only, so every rank gets the same bits
    (Note [rank-deficient matrices]).
    """
    r = p.shape[1]
    tiny = _REMAINDER * np.finfo(p.dtype).eps
    lengths = [np.sqrt(np.sum(p[:, i] * p[:, i])) for i in range(r)]  # before any projection
    for i in range(r):
        col = p[:, i]
        for j in range(i):  # again: what one pass left is rounding of the earlier columns
            done = p[:, j]
            col -= np.sum(done * col) * done
        norm = np.sqrt(np.sum(col * col))
        if norm > tiny * lengths[i] and norm + epsilon > 0:
            col /= norm + epsilon
        else:
            col[:] = 0
        for j in range(i + 1, r):
            other = p[:, j]
            other -= np.sum(col * other) * col
    return p


# Note [rank-deficient matrices]
#     A gradient of lower rank than PowerSGD's (a batch of one gives an outer product, a
#     bias broadcast a constant matrix) leaves columns of P that one pass of Gram-Schmidt
#     reduces to rounding: normalised, that rounding became a unit column not orthogonal to
#     the others, and the product P Pᵀ M counted the matrix's one direction twice (a
#     constant matrix at rank 4 came out 2.0 times too large, an outer product at rank 2
#     1.19 times). So each column is projected off the finished ones a second time ("twice
#     is enough"), and one left with less than _REMAINDER machine epsilons of its length
#     is a direction the matrix does not have: it is zeroed, and adds nothing.
_REMAINDER = 1000.0


def low_rank_product(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``p @ q.T`` as a sum of ``r`` outer products in column order (same bits everywhere)."""
    out: np.ndarray = np.multiply.outer(p[:, 0], q[:, 0])
    for j in range(1, p.shape[1]):
        out += np.multiply.outer(p[:, j], q[:, j])
    return out


class _State:
    __slots__ = ("error", "q", "shape")

    def __init__(self, q: np.ndarray, error: np.ndarray | None, shape: tuple[int, ...]) -> None:
        self.q = q
        self.error = error
        self.shape = shape  # the tensor's: (8, 3, 20) and (8, 60) are both 8 x 60 matrices


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start.

    Args:
        rank: columns of ``P`` and ``Q`` (1 to 4 is typical; more: closer to exact).
        min_compression_rate: compress only where ``n*m`` exceeds
            ``(n + m) * rank`` by this factor; plain allreduce elsewhere.
        warm_start: reuse the previous ``Q`` of the tensor (the paper's default).
        error_feedback: carry each rank's residual to its next call.
        seed: seeds the initial ``Q``.
        epsilon: added to column norms when orthogonalizing.

    State per compressed tensor: ``Q`` (``m x rank``) and the error (``n x m``),
    keyed as Note [compressor state] in :mod:`plait.compression.base` says.
    """

    name = "powersgd"

    def __init__(
        self,
        rank: int = 1,
        *,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        error_feedback: bool = True,
        seed: int = 0,
        epsilon: float = 0.0,
    ) -> None:
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or rank < 1:
            raise ValueError(f"PowerSGD: rank must be a positive int; got {rank!r}")
        if not min_compression_rate >= 1:
            raise ValueError(
                f"PowerSGD: min_compression_rate must be >= 1; got {min_compression_rate!r}"
            )
        if not epsilon >= 0:
            raise ValueError(f"PowerSGD: epsilon must be >= 0; got {epsilon!r}")
        self.rank = int(rank)  # a numpy integer too, kept as Python's
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = bool(warm_start)
        self.error_feedback = bool(error_feedback)
        self.seed = check_seed(seed, "PowerSGD")
        self.epsilon = float(epsilon)

    def __repr__(self) -> str:
        return (
            f"plait.compression.PowerSGD(rank={self.rank}, "
            f"min_compression_rate={self.min_compression_rate}, warm_start={self.warm_start}, "
            f"error_feedback={self.error_feedback}, seed={self.seed})"
        )

    @property
    def stateful(self) -> bool:
        """True: Q (warm start) and the error (error feedback) carry over."""
        return self.warm_start or self.error_feedback

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """``(n, m)`` a tensor of ``shape`` is compressed as, or None where it falls back."""
        if len(shape) < 2:
            return None
        n = shape[0]
        m = int(np.prod(shape[1:], dtype=np.int64))
        if (n + m) * self.rank * self.min_compression_rate >= n * m:
            return None
        return n, m

    def collectives(self, x: np.ndarray, comm: Communicator) -> int:
        """Two allreduces (P, Q), or one where the tensor falls back."""
        return 1 if self.matrix_shape(x.shape) is None else 2

    def _keeps_state(self, x: np.ndarray) -> bool:
        """Only compressed tensors keep state; one that falls back claims no key."""
        return self.stateful and self.matrix_shape(x.shape) is not None

    def _check_state(
        self, state: Any, x: np.ndarray, comm: Communicator, key: Hashable | None
    ) -> None:
        nm = self.matrix_shape(x.shape)
        wd = work_dtype(x.dtype)
        fits = (
            nm is not None
            and state.shape == x.shape
            and state.q.shape == (nm[1], self.rank)
            and state.q.dtype == wd
            and (state.error is None or state.error.shape == nm)
        )
        if not fits:
            raise ValueError(
                f"rank {comm.rank}: allreduce: {self.name}: the state kept for "
                f"{'key ' + repr(key) if key is not None else 'this array'} is for another "
                f"shape or dtype than x {x.shape} {x.dtype}. Give each tensor its own key "
                "(c.with_key(name)) or call reset()"
            )

    def allreduce(
        self,
        comm: Communicator,
        x: np.ndarray,
        *,
        average: bool = False,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Power-iteration step, two allreduces, low-rank product; see the module docstring."""
        nm = self.matrix_shape(x.shape)
        if nm is None:
            return _fallback(comm, x, average, timeout)
        n, m = nm
        r = self.rank
        wd = work_dtype(x.dtype)
        state = self._state(comm, key, x) if self.stateful else None
        big = x.reshape(n, m).astype(wd)  # native order (Note [byte order])
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            # Note [non-finite state]: inf and NaN in this step raise no warning of numpy's
            if self.error_feedback and state is not None and state.error is not None:
                big += state.error
            if self.warm_start and state is not None:
                q = state.q
            elif self.warm_start:
                q = self._first_q(n, m, wd)
            else:
                gen = self._shared(comm, "rng", lambda: np.random.default_rng(self.seed))
                q = gen.standard_normal((m, r)).astype(wd)

            p = comm.allreduce(big @ q, SUM, timeout=timeout)
            orthogonalize(p, self.epsilon)
            qi = big.T @ p
            q = comm.allreduce(qi, SUM, timeout=timeout)
            if average:
                q /= np.asarray(comm.size, wd)
            result = low_rank_product(p, q).astype(x.dtype).reshape(x.shape)
            if self.stateful:
                error = None
                if self.error_feedback:
                    big -= p @ qi.T
                    big[~np.isfinite(big)] = 0
                    error = big
                kept = q if np.isfinite(q).all() else self._first_q(n, m, wd)
                self._store(comm, key, x, _State(kept, error, x.shape))
        return result

    def _first_q(self, n: int, m: int, wd: np.dtype) -> np.ndarray:
        """The first ``Q`` of an ``n x m`` tensor: standard normal, the same on every rank."""
        rng = np.random.default_rng([self.seed, n, m, self.rank])
        q: np.ndarray = rng.standard_normal((m, self.rank)).astype(wd)
        return q


def _fallback(
    comm: Communicator, x: np.ndarray, average: bool, timeout: float | None
) -> np.ndarray:
    """The plain allreduce of a tensor PowerSGD does not compress (one collective).

    A SUM is the communicator's own. An AVG is a SUM in the working precision,
    divided by the number of ranks there and cast back to ``x``'s dtype, as every
    compressor averages: the communicator's AVG sums in ``x``'s dtype, so a
    float16 mean that float16 holds overflowed to inf on the way.
    """
    if not average:
        total: np.ndarray = comm.allreduce(x, SUM, timeout=timeout)
        return total
    wd = work_dtype(x.dtype)
    wide = x.astype(wd)  # native order (Note [byte order] in plait.compression.base)
    with np.errstate(over="ignore", invalid="ignore"):
        comm.allreduce(wide, SUM, out=wide, timeout=timeout)
        wide /= np.asarray(comm.size, wd)
        mean: np.ndarray = wide.astype(x.dtype)
    return mean
