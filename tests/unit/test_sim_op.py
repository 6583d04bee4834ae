"""plait.sim.simulate refuses an op that is not a plait.Op, as a communicator does."""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest

import plait
from plait import sim
from plait.sim import call
from plait.testing import RankFailure, run_ranks


def communicator_refusal(op: Any) -> str:
    """What a communicator's allreduce says of ``op``, less its ``rank N:`` prefix."""
    with pytest.raises(RankFailure) as failed:
        run_ranks(2, lambda comm: comm.allreduce(np.ones(4, np.float32), op=op))
    error = failed.value.errors[0]
    assert isinstance(error, TypeError)
    return str(error).removeprefix("rank 0: ")


@pytest.mark.parametrize("op", ["sum", np.add, "SUM"])
def test_simulate_refuses_an_op_that_is_not_an_op_as_a_communicator_does(op: Any) -> None:
    network = sim.flat(3, 1e-6, 1e-9)
    with (
        mock.patch.object(call, "build_program") as build,  # refused before any work
        pytest.raises(TypeError) as refused,
    ):
        sim.simulate("allreduce", "ring", 64, network, op=op)
    build.assert_not_called()
    message = str(refused.value)
    assert message.startswith("allreduce: op must be a plait.Op such as plait.SUM")
    assert message == communicator_refusal(op)


def test_simulate_refuses_a_name_for_a_collective_that_does_not_reduce() -> None:
    with pytest.raises(TypeError, match=r"allgather: op must be a plait\.Op.*got 'max'"):
        sim.simulate("allgather", "ring", 64, sim.flat(3, 1e-6, 1e-9), op="max")


def test_simulate_still_takes_ops_and_its_default() -> None:
    network = sim.flat(3, 1e-6, 1e-9)
    for op in (None, plait.SUM, plait.MAX, plait.Op(np.logaddexp)):
        result = sim.simulate("allreduce", "ring", 64, network, op=op, with_data=True)
        assert result.time > 0
    with pytest.raises(ValueError, match="BAND"):  # an Op the dtype has not: still ValueError
        sim.simulate("allreduce", "ring", 64, network, op=plait.BAND)
