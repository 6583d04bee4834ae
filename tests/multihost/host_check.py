"""Run on every rank of a job spread over emulated hosts (network namespaces).

``python host_check.py HOSTS NPROC ALGORITHMS`` (ALGORITHMS comma-separated):

1. the job really spans hosts: TCP transport, ``cross_size == HOSTS``,
   ``local_size == NPROC``, this rank's host index and local rank match the
   launcher's, and the address it listens on is on the emulated network
   (``MULTIHOST_EXPECT_ADDR``, a prefix such as ``10.77.0.``);
2. every allreduce algorithm named, on the whole job, for counts from 0 to a
   few MB, against a reference computed here, with the bits compared across
   ranks;
3. ``split_by_host``: a local group of NPROC ranks per host, a cross-host group
   (one rank per host) on which every named algorithm runs too, and a two-level
   allreduce (local reduce, cross allreduce, local broadcast) equal to the flat one.

Prints one ``rank R: ...`` line per stage; exits non-zero with the failing
case named on the first wrong result.
"""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np

import plait

#: Element counts per allreduce: empty, tiny, around the world size, odd, ~3 MB of int64.
COUNTS = (0, 1, 5, 13, 1001, 400_003)


def inputs(seed: int, rank: int, count: int) -> np.ndarray:
    """Rank ``rank``'s input for case ``seed``: the same in every process."""
    return np.random.default_rng([seed, rank]).integers(-(1 << 20), 1 << 20, count)


def check_allreduce(comm: plait.Communicator, name: str, where: str, members: list[int]) -> None:
    """``comm.allreduce`` with ``name`` for every count; ``members`` are its ranks' world ranks."""
    for count in COUNTS:
        seed = zlib.crc32(f"{where}/{name}/{count}".encode())
        x = inputs(seed, members[comm.rank], count)
        got = comm.allreduce(x, algorithm=name)
        want = sum((inputs(seed, m, count) for m in members), np.zeros(count, np.int64))
        if got.dtype != want.dtype or not np.array_equal(got, want):
            raise SystemExit(f"{where}: allreduce {name} count={count}: wrong result")
        digests = comm.allgather(np.array([zlib.crc32(got.tobytes())], np.int64))
        if not np.all(digests == digests[0]):
            raise SystemExit(f"{where}: allreduce {name} count={count}: ranks differ in bits")
        # Floats too (the values are small integers, so every order gives the same sum).
        f = comm.allreduce(x.astype(np.float32), plait.MAX, algorithm=name)
        if not np.array_equal(f, np.max([inputs(seed, m, count) for m in members], axis=0)):
            raise SystemExit(f"{where}: allreduce {name} MAX float32 count={count}: wrong result")


def main() -> int:
    hosts, nproc, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    node = int(os.environ["PLAIT_NODE_RANK"])
    local_rank = int(os.environ["PLAIT_LOCAL_RANK"])
    expect_addr = os.environ.get("MULTIHOST_EXPECT_ADDR", "10.77.0.")
    with plait.init(timeout=60) as comm:
        r = comm.rank
        t = comm._transport
        transport = type(t).__name__
        # Several ranks per host: shared memory next door, TCP (its address) to the others.
        address = getattr(t.tcp if transport == "HybridTransport" else t, "address", "?")
        print(
            f"rank {r}: transport={transport} address={address} host={comm.host} "
            f"cross_size={comm.cross_size} cross_rank={comm.cross_rank} "
            f"local_size={comm.local_size} local_rank={comm.local_rank}",
            flush=True,
        )
        facts = {
            "transport": (transport, "HybridTransport" if nproc > 1 else "TcpTransport"),
            "size": (comm.size, hosts * nproc),
            "cross_size": (comm.cross_size, hosts),
            "cross_rank": (comm.cross_rank, node),
            "local_size": (comm.local_size, nproc),
            "local_rank": (comm.local_rank, local_rank),
        }
        for what, (got, want) in facts.items():
            if got != want:
                raise SystemExit(f"rank {r}: {what} is {got!r}, expected {want!r}")
        if not address.startswith(expect_addr):
            raise SystemExit(f"rank {r}: listens on {address}, expected {expect_addr}*")
        unknown = [n for n in names if n not in plait.algorithms("allreduce")]
        if unknown:
            raise SystemExit(f"rank {r}: no allreduce algorithm(s) {unknown}")

        everyone = list(range(comm.size))
        for name in names:
            check_allreduce(comm, name, "world", everyone)
        print(f"rank {r}: world allreduce ok: {','.join(names)}", flush=True)

        local = comm.split_by_host()
        mine = [q for q in everyone if comm.hosts[q] == comm.host]
        if (local.size, local.rank, local.cross_size) != (nproc, local_rank, 1):
            raise SystemExit(f"rank {r}: split_by_host gave rank {local.rank} of {local.size}")
        total = local.allreduce(np.array([r], np.int64))[0]
        if total != sum(mine):
            raise SystemExit(f"rank {r}: local allreduce gave {total}, expected {sum(mine)}")

        cross = comm.split(comm.local_rank, key=comm.rank)
        peers = [q for q in everyone if q % nproc == local_rank]
        if (cross.size, cross.rank, cross.cross_size, cross.local_size) != (hosts, node, hosts, 1):
            raise SystemExit(f"rank {r}: cross group is rank {cross.rank} of {cross.size}")
        for name in names:
            check_allreduce(cross, name, f"cross{local_rank}", peers)

        # Two levels by hand: reduce on the host, allreduce across, broadcast on the host.
        x = inputs(7, r, 100_001)
        flat = comm.allreduce(x)
        part = local.reduce(x, root=0)
        part = cross.allreduce(part) if local.rank == 0 else np.empty_like(x)
        local.broadcast(part, root=0)
        if not np.array_equal(part, flat):
            raise SystemExit(f"rank {r}: two-level allreduce differs from the flat one")
        local.close()
        cross.close()
        comm.barrier()
        print(f"rank {r}: split_by_host ok: local {local.size} cross {cross.size}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
