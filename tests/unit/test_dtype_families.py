"""Which dtypes plait moves and reduces: numpy's own, and bfloat16 of ml_dtypes.

ml_dtypes gives some of its types numpy's kinds 'c' and 'f' (complex32, float8_e5m2), and
they were taken for complex and float: complex32's PROD failed midway on one rank (its
``.real`` is no float view), which broke the communicator on every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import plait
from plait.ops import dtype_family
from plait.testing import run_ranks

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")

pytestmark = pytest.mark.timeout(60)

OTHER_TYPES = [name for name in ("complex32", "float8_e5m2") if hasattr(ml_dtypes, name)]


@pytest.mark.parametrize("name", OTHER_TYPES)
def test_types_of_another_package_with_numpys_kinds_are_refused_before_a_byte_moves(
    name: str,
) -> None:
    dtype = np.dtype(getattr(ml_dtypes, name))
    assert dtype_family(dtype) == "unsupported"

    def body(comm: plait.Communicator) -> Any:
        x = np.arange(4).astype(dtype)
        with pytest.raises(TypeError, match=rf"dtype {name} is not supported"):
            comm.allreduce(x, plait.PROD)
        return comm.allreduce(np.ones(2))  # the communicator is still usable

    for got in run_ranks(2, body):
        np.testing.assert_array_equal(got, [2.0, 2.0])


@pytest.mark.parametrize(
    ("dtype", "family"),
    [
        (np.dtype(">f8"), "float"),
        (np.dtype(np.float16), "float"),
        (np.dtype(np.longdouble), "float"),
        (np.dtype(">c16"), "complex"),
        (np.dtype(np.clongdouble), "complex"),
        (np.dtype(ml_dtypes.bfloat16), "float"),
        (np.dtype(ml_dtypes.float8_e4m3fn), "unsupported"),
    ],
    ids=str,
)
def test_numpys_types_and_bfloat16_keep_their_families(dtype: np.dtype, family: str) -> None:
    assert dtype_family(dtype) == family


@pytest.mark.skipif("float8_e5m2" not in OTHER_TYPES, reason="ml_dtypes has no float8_e5m2")
def test_compression_refuses_another_packages_float_too() -> None:
    """Compression's own check of float data read the kind alone, and compressed float8_e5m2
    while a plain allreduce of it was refused."""
    from plait.bucketing import Bucketer
    from plait.compression import FP16

    dtype = np.dtype(ml_dtypes.float8_e5m2)

    def body(comm: plait.Communicator) -> None:
        x = np.arange(8).astype(dtype)
        with pytest.raises(TypeError, match="compression needs float16, float32 or float64"):
            comm.allreduce(x, compression=FP16())
        with pytest.raises(TypeError, match=r"gradient 0.*float8_e5m2"):
            Bucketer(comm, [x], compression=FP16())

    run_ranks(2, body)
