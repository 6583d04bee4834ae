"""plait.mpi's Status as mpi4py's: compared by value, its count and fields set as mpi4py
sets them. Every expected value is what mpi4py 4.1 on Open MPI 4.1 gave."""

from __future__ import annotations

import pytest

from plait import mpi as MPI


def test_statuses_compare_by_value() -> None:
    """``MPI.Status() == MPI.Status()`` and ``MPI.Status(st) == st`` were False."""
    st = MPI.Status()
    st.source = 1
    assert MPI.Status() == MPI.Status()
    assert MPI.Status(st) == st
    assert st != MPI.Status()
    assert st != 1
    for change in (
        lambda s: s.Set_tag(3),
        lambda s: s.Set_error(5),
        lambda s: s.Set_elements(MPI.BYTE, 4),
        lambda s: s.Set_cancelled(True),
    ):
        other = MPI.Status(st)
        change(other)
        assert other != st
    with pytest.raises(TypeError, match="unhashable"):
        hash(st)


def test_a_status_count_is_set_as_mpi4py_sets_it() -> None:
    """``st.count = 16`` raised a plain AttributeError; mpi4py's is Set_elements(BYTE, 16)."""
    st = MPI.Status()
    st.count = 16
    assert (st.count, st.Get_count(), st.Get_count(MPI.DOUBLE)) == (16, 16, 2)
    st.Set_elements(MPI.DOUBLE, 3)
    assert (st.count, st.Get_count(MPI.DOUBLE), st.Get_elements(MPI.INT)) == (24, 3, 6)
    st.count = 2.5  # a float is truncated, as a C count
    assert st.count == 2
    st.count = True
    assert st.count == 1
    with pytest.raises(MPI.Exception, match="MPI_ERR_COUNT: invalid count argument") as info:
        st.count = -1
    assert info.value.Get_error_class() == MPI.ERR_COUNT
    with pytest.raises(MPI.Exception, match="MPI_ERR_COUNT"):
        st.Set_elements(MPI.DOUBLE, -1)
    for bad in ("x", None):
        with pytest.raises(TypeError, match="an integer is required"):
            st.count = bad
    with pytest.raises(TypeError, match="datatype"):
        st.Set_elements("d", 2)
    assert st.count == 1  # nothing refused changed it


def test_a_status_error_and_cancelled_are_set_as_mpi4py_sets_them() -> None:
    st = MPI.Status()
    st.Set_error(2.5)
    st.Set_cancelled(1)
    assert (st.Get_error(), st.error, st.Is_cancelled(), st.cancelled) == (2, 2, True, True)
    st.Set_cancelled(0)
    assert st.cancelled is False
    with pytest.raises(TypeError, match="an integer is required"):
        st.Set_error("x")
