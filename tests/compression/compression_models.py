"""Numpy models of the compressors, written apart from plait's code: all ranks' inputs at once.

Each model returns what every rank should get. Where the method sums its
payloads in rank order (int8, top-k) the model does the same float32
operations in the same order, so results must agree bit for bit; where a
plait allreduce sums in its algorithm's order (casts, PowerSGD), tests use
inputs whose sums are exact, or a tolerance.
"""

from __future__ import annotations

import math
import struct

import numpy as np


def bf16_bits_scalar(value: float) -> int:
    """bfloat16 bits of one float32 value, by the textbook rule, one value at a time."""
    (u,) = struct.unpack("<I", struct.pack("<f", value))
    if math.isnan(value):
        return (u >> 16) | 0x40
    upper, lower = u >> 16, u & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1  # may carry into the exponent: the largest values become inf
    return upper & 0xFFFF


def int8_blocks(v: np.ndarray, block: int, noise: np.ndarray | None) -> np.ndarray:
    """Quantize and dequantize ``v`` block by block (float32 arithmetic, one block at a time)."""
    v = v.astype(np.float32)
    out = np.empty_like(v)
    for start in range(0, v.size, block):
        chunk = v[start : start + block]
        scale = np.float32(np.max(np.abs(chunk))) / np.float32(127) if chunk.size else 0
        scale = np.float32(scale)
        if scale == 0:
            out[start : start + block] = 0
            continue
        y = chunk / scale
        codes = np.rint(y) if noise is None else np.floor(y + noise[start : start + block])
        codes = np.clip(codes, -127, 127).astype(np.int8)
        out[start : start + block] = codes.astype(np.float32) * scale
    return out


def int8_allreduce(
    xs: list[np.ndarray], block: int, *, stochastic: bool = False, seed: int = 0, calls: int = 1
) -> list[np.ndarray]:
    """Results of ``calls`` successive Int8 allreduces of the same inputs (draws advance)."""
    p = len(xs)
    count = xs[0].size
    shard = -(-count // p)
    gens = [np.random.default_rng([seed, r]) for r in range(p)]
    results = []
    for _ in range(calls):
        noise1 = [g.random(p * shard, dtype=np.float32) if stochastic else None for g in gens]
        flat = [np.zeros(p * shard, np.float32) for _ in range(p)]
        for r in range(p):
            flat[r][:count] = xs[r].reshape(-1)
        # step 1: every rank quantizes every shard; step 2: shard s summed in rank order on rank s
        deq = [
            [
                int8_blocks(
                    flat[q][s * shard : (s + 1) * shard],
                    block,
                    None if noise1[q] is None else noise1[q][s * shard : (s + 1) * shard],
                )
                for s in range(p)
            ]
            for q in range(p)
        ]
        full = np.empty(p * shard, np.float32)
        for s in range(p):
            total = np.zeros(shard, np.float32)
            for q in range(p):
                total += deq[q][s]
            noise2 = gens[s].random(shard, dtype=np.float32) if stochastic else None
            full[s * shard : (s + 1) * shard] = int8_blocks(total, block, noise2)
        results.append(full[:count].astype(xs[0].dtype).reshape(xs[0].shape))
    return results


def topk_steps(steps: list[list[np.ndarray]], ratio: float) -> list[np.ndarray]:
    """Top-k with error feedback over several steps; ``steps[t][r]`` is rank r's input at step t."""
    p = len(steps[0])
    shape = steps[0][0].shape
    count = steps[0][0].size
    k = min(count, max(1, math.ceil(ratio * count)))
    residual = [np.zeros(count, np.float32) for _ in range(p)]
    results = []
    for xs in steps:
        out = np.zeros(count, np.float32)
        for r in range(p):
            acc = xs[r].reshape(-1).astype(np.float32) + residual[r]
            order = np.argsort(-np.abs(acc), kind="stable")[:k]
            sent = acc[order]
            residual[r] = acc.copy()
            residual[r][order] = 0
            np.add.at(out, order, sent)  # rank r's indices are distinct
        results.append(out.reshape(shape))
    return results


def powersgd_steps(
    steps: list[list[np.ndarray]], rank: int, q0: np.ndarray, *, average: bool = False
) -> list[np.ndarray]:
    """PowerSGD (error feedback, warm start) in float64 from the first ``Q``; for tolerances."""
    p = len(steps[0])
    n = steps[0][0].shape[0]
    m = steps[0][0].size // n
    q = q0.astype(np.float64)
    errors = [np.zeros((n, m)) for _ in range(p)]
    results = []
    for xs in steps:
        ms = [x.reshape(n, m).astype(np.float64) + e for x, e in zip(xs, errors, strict=True)]
        big_p = sum(mi @ q for mi in ms)
        basis, _ = np.linalg.qr(big_p)
        # QR's columns may differ in sign from Gram-Schmidt's; P^ P^T does not care.
        qis = [mi.T @ basis for mi in ms]
        q = sum(qis)
        if average:
            q = q / p
        approx = basis @ q.T
        errors = [mi - basis @ qi.T for mi, qi in zip(ms, qis, strict=True)]
        results.append(approx)
        assert rank == basis.shape[1]
    return results
