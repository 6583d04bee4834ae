"""``simulate`` and ``plait sim`` refuse what they cannot run, before they run it.

An op the dtype does not have (``band`` on floats, ``avg`` on integers), a root that
is no rank, a negative size and a topology given parameters it does not take are
mistakes in the call: ``simulate`` raises ValueError and ``plait sim`` exits 2 with
one line, as ``plait bench`` does, instead of a traceback from inside the run or a
table that ignored them. A barrier moves no data: one row of 0 bytes, no bandwidth.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plait import sim
from plait.cli.__main__ import main
from plait.ops import AVG, BAND

NET = sim.flat(4, 1e-6, 1e-9)


@pytest.mark.parametrize("with_data", [False, True])
def test_simulate_refuses_an_op_the_dtype_does_not_have(with_data: bool) -> None:
    # With data BAND ended in numpy's TypeError inside the engine and AVG on int32 in a
    # casting error; without, both were timed as if they could run.
    with pytest.raises(ValueError, match=r"op BAND is not defined for float32 \(float\)"):
        sim.simulate("allreduce", "ring", 1024, NET, op=BAND, with_data=with_data)
    with pytest.raises(ValueError, match=r"op AVG is not defined for int32 \(int\)"):
        sim.simulate(
            "reduce_scatter", "ring", 1024, NET, op=AVG, dtype=np.int32, with_data=with_data
        )
    sim.simulate("allreduce", "ring", 1024, NET, op=BAND, dtype=np.int32, with_data=with_data)


def test_simulate_checks_the_root_and_the_size() -> None:
    # A reduce to -1 returned no output anywhere, and passed; a broadcast from 9 blamed a
    # rank's peer; a negative size raised an IndexError from the builder.
    for root in (-1, 4, 9):
        for collective in ("reduce", "broadcast"):
            with pytest.raises(ValueError, match=rf"root must be a rank, in 0\.\.3; got {root}"):
                sim.simulate(collective, "binomial", 64, NET, root=root, with_data=True)
    with pytest.raises(ValueError, match="nbytes must be >= 0; got -1024"):
        sim.simulate("allreduce", "ring", -1024, NET)
    with pytest.raises(ValueError, match=r"root must be a rank, in 0\.\.3; got -1"):
        sim.build_all("reduce", "binomial", 4, 8, root=-1)
    with pytest.raises(ValueError, match="count must be >= 0; got -2"):
        sim.build_all("allreduce", "ring", 4, -2)
    res = sim.simulate("reduce", "binomial", 64, NET, root=3, with_data=True)
    assert res.outputs is not None
    assert res.outputs[3] is not None  # the root's result, checked against the reference


def test_simulate_refuses_arguments_that_are_not_integers() -> None:
    # A float root failed inside the tree's arithmetic ("unsupported operand type(s) for &"),
    # a string one in a comparison, True was taken for rank 1; segment_bytes=1.5 and a
    # negative window were accepted.
    for root in (1.0, "1", True):
        with pytest.raises(TypeError, match=rf"root must be an int; got {root!r}"):
            sim.simulate("reduce", "binomial", 1200, NET, root=root)
        with pytest.raises(TypeError, match="root must be an int"):
            sim.build_all("reduce", "binomial", 4, 8, root=root)
    with pytest.raises(TypeError, match=r"nbytes must be an int; got 64\.0"):
        sim.simulate("allreduce", "ring", 64.0, NET)
    with pytest.raises(TypeError, match=r"segment_bytes must be an int; got 1\.5"):
        sim.simulate("allreduce", "ring", 1200, NET, segment_bytes=1.5)
    with pytest.raises(ValueError, match="window must be >= 0 bytes"):
        sim.simulate("allreduce", "arena", 1200, NET, window=-1)
    with pytest.raises(TypeError, match="window must be an int"):
        sim.simulate("allreduce", "arena", 1200, NET, window=2.5)
    root = np.uint8(3)  # a numpy integer serves, as a communicator takes it
    res = sim.simulate("reduce", "binomial", 64, NET, root=root, with_data=True)
    assert res.outputs is not None
    assert res.outputs[3] is not None


def test_simulate_refuses_sizes_beyond_int64() -> None:
    # 2**63 bytes timed recursive doubling as 0.0 s (its bytes wrapped around in int64) and
    # 2**70 raised OverflowError from inside the program's arrays.
    net = sim.flat(4, 1e-6, 8e-11)
    for nbytes in (2**63, 2**70):
        with pytest.raises(ValueError, match=rf"nbytes must be at most {sim.MAX_BYTES}.*{nbytes}"):
            sim.simulate("allreduce", "recursive_doubling", nbytes, net)
    with pytest.raises(ValueError, match=r"count must be at most 2305843009213693951 \(4-byte"):
        sim.build_all("allreduce", "ring", 4, 2**61, itemsize=4)
    with pytest.raises(ValueError, match=r"allgatherv: counts make a buffer of \d+ B; expected"):
        sim.simulate("allgatherv", "ring", 0, net, counts=[2**62] * 4)
    # The largest size itself is timed right: two exchanges of the whole vector.
    res = sim.simulate("allreduce", "recursive_doubling", sim.MAX_BYTES, net)
    assert res.time == pytest.approx(2 * (1e-6 + res.nbytes * 8e-11), rel=1e-12)
    assert res.nbytes == sim.MAX_BYTES - 3  # whole float32 elements


def test_simulate_refuses_a_negative_segment() -> None:
    # It was taken as unsegmented, while plait sim --segment -1 was refused.
    with pytest.raises(ValueError, match=r"segment_bytes must be >= 0 .*; got -1000000000"):
        sim.simulate("allreduce", "ring", 4096, NET, segment_bytes=-(10**9))
    assert sim.simulate("allreduce", "ring", 4096, NET, segment_bytes=0).time > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-o", "band", "-d", "float32", "--with-data"],
         "band on float32: op BAND is not defined for float32 (float); it needs bool or int data"),
        (["-o", "band", "-d", "float32"], "band on float32: op BAND is not defined"),
        (["-o", "avg", "-d", "int32", "--with-data"],
         "avg on int32: op AVG is not defined for int32 (int); it needs float or complex data"),
        (["--topology", "ring:3"], "--topology 'ring:3': ring takes no parameters; expected ring"),
        (["--topology", "flat-free:7"], "flat-free takes no parameters; expected flat-free"),
        (["--topology", "switch:9"], "switch takes no parameters; expected switch"),
        (["--topology", "flat:"], "flat takes no parameters"),
        (["--topology", "hosts:2:1:3"],
         "hosts takes at most 2 parameters; expected hosts:K[:NICS]"),
        (["--topology", "torus:2x2:1"],
         "torus takes at most 1 parameter; expected torus:AxB[xC...]"),
        (["--topology", "fat-tree:2:1:1:1"], "fat-tree takes at most 3 parameters"),
        # Each cost names its own option: these blamed --alpha, --beta or --topology.
        (["--topology", "hosts:2", "--intra-alpha", "-1"],
         "--intra-alpha must be a finite number >= 0 (seconds per message); got -1.0"),
        (["--topology", "hosts:2", "--intra-beta", "nan"],
         "--intra-beta must be a finite number >= 0 (seconds per byte); got nan"),
        (["--gamma", "-1"], "--gamma must be a finite number >= 0 (seconds per byte); got -1.0"),
        (["--topology", "hosts:2", "--delta", "-1"],
         "--delta must be a finite number >= 0 (seconds per byte); got -1.0"),
        (["--beta", "inf"], "--beta must be a finite number >= 0 (seconds per byte); got inf"),
        (["--wait-latency", "-1"], "--wait-latency must be a finite number >= 0 (seconds)"),
        # Said: --ranks 4 is not a multiple of 0 ranks per host.
        (["--topology", "hosts:0"],
         "--topology 'hosts:0': K must be at least 1 rank per host; got 0; expected hosts:K"),
        (["--topology", "hosts:-2"], "K must be at least 1 rank per host; got -2"),
        # 2**63 B: a wrong bandwidth; 2**70 B: an OverflowError traceback.
        (["-s", "8589934592G"], "-s: 8589934592G is 9223372036854775808 B, above the largest "
         "size, 2**63 - 1 B"),
        (["-s", "1099511627776G"], "-s: 1099511627776G is 1180591620717411303424 B, above"),
        (["-b", "1K", "-e", "9223372036854775808"], "-e: 9223372036854775808 is 92233720368547"),
        # Listed by plait algorithms, and said to be an unknown collective.
        (["allgatherv"], "plait sim sweeps sizes, and allgatherv takes per-rank counts: "
         "simulate it with the Python API, plait.sim.simulate('allgatherv', ALGO, 0, network, "
         "counts=[...]), or give one of allreduce"),
        (["-c", "reduce_scatterv"], "plait.sim.simulate('reduce_scatterv', ALGO, 0, network"),
    ],
)  # fmt: skip
def test_plait_sim_refuses_with_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    sizes = [] if "-b" in argv or "-s" in argv else ["-s", "1K"]
    assert main(["sim", "-n", "4", *sizes, "-a", "ring", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: plait sim")
    assert err.splitlines()[-1].startswith("plait sim: error: ")
    assert message in err


def test_the_largest_size_runs(capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "-n", "2", "-a", "ring", "-s", "9223372036854775807", "--no-progress"]) == 0
    assert "9223372036854775804" in capsys.readouterr().out  # whole float32 elements


def test_parameters_a_topology_takes_still_work(capsys: pytest.CaptureFixture) -> None:
    for spec in ("fat-tree:2:1:2", "hosts:2:2", "torus:2x2"):
        assert main(["sim", "-n", "4", "--topology", spec, "-s", "1K", "-a", "ring"]) == 0
    assert "1024" in capsys.readouterr().out


def test_a_barrier_moves_no_bytes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # It reported 1024 bytes at 0.512 GB/s for -s 1K, and a row per size; plait bench
    # gives the barrier one row of 0 bytes and no bandwidth.
    out = tmp_path / "barrier.json"
    rc = main(["sim", "barrier", "-n", "4", "-b", "1K", "-e", "64K", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("# plait sim: barrier, flat")  # no dtype, as bench
    records = json.loads(out.read_text())["results"]
    assert {r["algorithm"] for r in records} == {"arena", "dissemination"}
    for r in records:
        assert (r["bytes"], r["algbw_gbps"], r["busbw_gbps"]) == (0, 0.0, 0.0)
        assert r["time_s"] > 0
    rows = [ln.split() for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert [(row[0], row[1], row[-3], row[-2]) for row in rows] == [
        ("0", "0", "0.000", "0.000")
    ] * 2


def test_one_rank_is_said_in_the_singular(capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "-n", "1", "-s", "1K", "-a", "ring"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert ", 1 rank, " in header
    assert "ranks" not in header
