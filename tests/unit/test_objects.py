"""Objects as frames (plait.objects): round trips, zero copies, 64-bit lengths, the rank-order fold.

Every round trip goes the way the object collectives will: :func:`dumps`, :func:`pack`,
each message received into fresh memory from :func:`empty` (a copy, as a transport makes),
:func:`unpack` and :func:`loads`. Objects above 2 GiB are checked through the length table
and through a mocked transport over untouched anonymous memory, so nothing that large is
ever allocated or copied.
"""

from __future__ import annotations

import importlib.abc
import mmap
import operator
import pickle
import struct
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, cast

import numpy as np
import pytest

from plait import objects
from plait.objects import (
    ALIGN,
    OOB_MIN,
    PICKLE_FAILED,
    SEPARATE_MIN,
    Frames,
    Layout,
    dumps,
    empty,
    loads,
    pack,
    pack_into,
    pack_lengths,
    reduce_in_rank_order,
    unpack,
    unpack_lengths,
)

SPLITS = pytest.mark.parametrize("separate_min", [None, SEPARATE_MIN], ids=["one", "separate"])


def _address(x: Any) -> int:
    """The address of the first byte of an ndarray or a memoryview."""
    return int(np.frombuffer(x, dtype=np.uint8).ctypes.data)


def _receive(messages: Sequence[memoryview]) -> list[memoryview]:
    """What a transport delivers: each message copied into fresh receive memory."""
    out = []
    for msg in messages:
        into = empty(msg.nbytes)
        into[:] = msg
        out.append(into)
    return out


def _round_trip(obj: object, separate_min: int | None) -> tuple[Any, list[memoryview]]:
    received = _receive(pack(dumps(obj), separate_min=separate_min))
    header, buffers = unpack(received, separate_min=separate_min)
    return loads(header, buffers), received


def _assert_same(a: Any, b: Any) -> None:
    """Equal values and types, arrays compared by dtype, shape and contents."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        if a.dtype == object:
            assert list(a) == list(b)
        elif a.dtype.names is not None:  # structured: compare the records' bytes
            assert a.tobytes() == b.tobytes()
        else:
            np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(16)
    big = rng.standard_normal((300, 200))
    return {
        "f32": np.arange(1000, dtype=np.float32),
        "i8": np.arange(-100, 100, dtype=np.int8),
        "u64": np.arange(500, dtype=np.uint64) * 2**40,
        "f16": np.linspace(0, 1, 700).astype(np.float16),
        "c128": (rng.standard_normal(300) + 1j * rng.standard_normal(300)),
        "bool": rng.standard_normal(2000) > 0,
        "big_endian": np.arange(400, dtype=">f8"),
        "longdouble": np.arange(100, dtype=np.longdouble) / 3,
        "zero_d": np.array(3.25),
        "empty": np.zeros((0, 7), dtype=np.int32),
        "fortran": np.asfortranarray(big),
        "strided": big[::3, ::2],
        "small_strided": np.arange(40.0)[::4],
        "transposed_3d": np.arange(6000, dtype=np.int16).reshape(4, 50, 30).transpose(2, 0, 1),
        "structured": np.array(
            [(i, i / 2, b"ab") for i in range(300)],
            dtype=[("n", "<i4"), ("x", "<f8"), ("s", "S2")],
        ),
        "objects": np.array([1, "two", None, (3,)], dtype=object),
        "big": big,
    }


@SPLITS
def test_nested_objects_with_arrays_of_every_kind_round_trip(separate_min: int | None) -> None:
    arrays = _arrays()
    obj = {
        "arrays": arrays,
        "nested": [arrays["f32"], (arrays["zero_d"], {"deep": [arrays["strided"], None]})],
        "bytes": b"\x00\x01plait" * 1000,
        "small_bytes": b"xy",
        "bytearray": bytearray(range(256)) * 20,
        "text": "héllo",
        "numbers": (1, 2.5, 3 + 4j, 2**100),
        "set": frozenset({1, 2, 3}),
        "none": None,
    }
    out, _ = _round_trip(obj, separate_min)
    _assert_same(out, obj)
    # a non-contiguous array arrives contiguous, with its values
    assert out["arrays"]["strided"].flags.c_contiguous


@pytest.mark.parametrize("value", [0, None, "", (), [], {}, b"", "x" * 100_000, list(range(5000))])
def test_plain_objects_without_buffers_round_trip(value: object) -> None:
    frames = dumps(value)
    assert frames.buffers == ()
    out, received = _round_trip(value, SEPARATE_MIN)
    assert out == value
    assert type(out) is type(value)
    assert len(received) == 1


def test_a_shared_array_arrives_once_and_stays_shared() -> None:
    a = np.arange(10_000.0)
    frames = dumps([a, a, {"again": a}])
    assert len(frames.buffers) == 1
    out, _ = _round_trip([a, a, {"again": a}], None)
    assert out[0] is out[1] is out[2]["again"]


@SPLITS
def test_a_large_array_is_never_copied_into_the_pickle_nor_on_load(
    separate_min: int | None,
) -> None:
    big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
    frames = dumps({"weights": big, "step": 7})
    assert len(frames.header) < 200, "the array's bytes must not be in the pickle"
    assert frames.buffer_lens == (big.nbytes,)
    # the frame is the array's own memory: nothing was copied on the sender
    assert _address(frames.buffers[0]) == big.ctypes.data

    messages = pack(frames, separate_min=separate_min)
    received = _receive(messages)
    out = loads(*unpack(received, separate_min=separate_min))
    np.testing.assert_array_equal(out["weights"], big)
    assert out["weights"].flags.writeable

    layout = Layout.read(received[0], separate_min=separate_min)
    if separate_min is None:
        # one message: the array is the message's memory at its offset
        assert len(messages) == 1
        offset = layout.offsets[0]
        assert offset is not None
        assert out["weights"].ctypes.data == _address(received[0]) + offset
    else:
        # the array travels as a message of its own, sent from its own memory ...
        assert len(messages) == 2
        assert layout.separate == (0,)
        assert _address(messages[1]) == big.ctypes.data
        assert messages[0].nbytes == layout.first_nbytes <= 256
        # ... and the received buffer IS the loaded array's memory
        assert out["weights"].ctypes.data == _address(received[1])
    assert np.shares_memory(out["weights"], np.frombuffer(received[-1], dtype=np.uint8))


def test_a_non_contiguous_array_is_made_contiguous_once() -> None:
    base = np.arange(100_000, dtype=np.float64)
    view = base[::2]
    frames = dumps(view)
    assert len(frames.header) < 200
    assert frames.buffer_lens == (view.nbytes,)
    assert not np.shares_memory(np.frombuffer(frames.buffers[0], np.uint8), base)
    np.testing.assert_array_equal(np.frombuffer(frames.buffers[0], np.float64), view)


def test_small_buffers_stay_in_the_pickle() -> None:
    small = np.arange(OOB_MIN // 8 - 1, dtype=np.float64)
    assert dumps(small).buffers == ()
    assert len(dumps(np.arange(OOB_MIN // 8, dtype=np.float64)).buffers) == 1


def test_every_array_received_into_empty_memory_is_aligned() -> None:
    arrays = [np.arange(n, dtype=np.complex128) for n in (64, 100, 129, 1000, 5000)]
    for separate_min in (None, SEPARATE_MIN):
        out, _ = _round_trip(arrays, separate_min)
        for arr in out:
            assert arr.ctypes.data % ALIGN == 0
            assert arr.flags.aligned


def test_a_read_only_buffer_gives_a_read_only_array_without_a_copy() -> None:
    big = np.arange(10_000, dtype=np.int64)
    header, buffers = unpack(pack(dumps(big)))
    frozen = [bytes(b) for b in buffers]
    out = loads(bytes(header), frozen)
    np.testing.assert_array_equal(out, big)
    assert not out.flags.writeable
    # bytearray memory, on the other hand, becomes the array
    mutable = [bytearray(b) for b in buffers]
    out = loads(bytes(header), mutable)
    assert out.flags.writeable
    assert out.ctypes.data == _address(mutable[0])


def test_a_picklebuffer_travels_out_of_band_and_arrives_as_the_received_memory() -> None:
    payload = bytearray(b"z" * (SEPARATE_MIN + 10))
    out, received = _round_trip(pickle.PickleBuffer(payload), SEPARATE_MIN)
    assert bytes(out) == bytes(payload)
    assert _address(out) == _address(received[1])


def test_messages_of_several_ranks_end_to_end_stay_aligned_and_uncopied() -> None:
    """What allgatherv and gatherv deliver: every rank's single message, back to back."""
    objs = [{"rank": r, "x": np.full(1000 + 37 * r, r, dtype=np.float64)} for r in range(4)]
    firsts = [pack(dumps(o))[0] for o in objs]
    sizes = [m.nbytes for m in firsts]
    assert all(n % ALIGN == 0 for n in sizes)
    whole = empty(sum(sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for r, msg in enumerate(firsts):
        whole[offsets[r] : offsets[r + 1]] = msg
    for r in range(4):
        piece = whole[offsets[r] : offsets[r + 1]]
        out = loads(*unpack([piece]))
        assert out["rank"] == r
        np.testing.assert_array_equal(out["x"], objs[r]["x"])
        assert out["x"].ctypes.data % ALIGN == 0
        assert np.shares_memory(out["x"], np.frombuffer(whole, np.uint8))


def test_pack_into_lays_objects_end_to_end_without_a_second_copy() -> None:
    """What a root does for scatterv (and every rank for alltoallv)."""
    frames = [dumps({"to": r, "x": np.arange(300 * (r + 1))}) for r in range(3)]
    sizes = [Layout.of(len(f.header), f.buffer_lens).first_nbytes for f in frames]
    send = empty(sum(sizes))
    start = 0
    for f, n in zip(frames, sizes, strict=True):
        pack_into(f, send[start : start + n])
        start += n
    start = 0
    for r, n in enumerate(sizes):
        out = loads(*unpack([send[start : start + n]]))
        assert out["to"] == r
        np.testing.assert_array_equal(out["x"], np.arange(300 * (r + 1)))
        start += n


# -- the length table and 64-bit lengths --------------------------------------------------


def test_the_length_table_is_little_endian_64_bit_words() -> None:
    table = pack_lengths(123, [2**31, 0, 2**40 + 5])
    assert table == struct.pack("<5Q", 3, 123, 2**31, 0, 2**40 + 5)
    assert unpack_lengths(table) == (123, (2**31, 0, 2**40 + 5))
    frames = dumps([np.ones(1000), np.zeros(2000, np.int8)])
    assert unpack_lengths(frames.table) == (len(frames.header), frames.buffer_lens)


@pytest.mark.parametrize(
    "lens", [[2**31], [2**31 + 1, 2**32, 2**33 + 7], [5, 2**63, 2**64 - 1]], ids=str
)
def test_lengths_beyond_2_gib_survive_the_table_and_the_layout(lens: list[int]) -> None:
    pickle_len = 2**32 + 3  # a pickle above 4 GiB, too
    assert unpack_lengths(pack_lengths(pickle_len, lens)) == (pickle_len, tuple(lens))
    layout = Layout.of(pickle_len, lens, separate_min=SEPARATE_MIN)
    assert layout.separate == tuple(i for i, n in enumerate(lens) if n >= SEPARATE_MIN)
    assert layout.message_lens[1:] == tuple(n for n in lens if n >= SEPARATE_MIN)
    whole = Layout.of(pickle_len, lens)
    end = whole.header_offset + pickle_len
    for off, n in zip(whole.offsets, lens, strict=True):
        assert off is not None
        assert off >= end
        assert off % ALIGN == 0
        end = off + n
    assert whole.first_nbytes % ALIGN == 0
    assert whole.first_nbytes - end < ALIGN


class _HugeBuffer:
    """Stands in for a memoryview of ``nbytes`` that is never allocated (pack only sizes it)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def test_pack_passes_huge_buffers_through_untouched() -> None:
    huge = [_HugeBuffer(3 * 2**31), _HugeBuffer(2**33 + 1)]
    small = memoryview(bytes(range(200)) * 10)
    stubs = [cast(memoryview, h) for h in huge]
    frames = Frames(b"\x80\x05header.", (stubs[0], small, stubs[1]))
    messages = pack(frames, separate_min=SEPARATE_MIN)
    assert messages[1:] == stubs, "huge buffers go out as they are, uncopied"
    layout = Layout.read(messages[0], separate_min=SEPARATE_MIN)
    assert layout.buffer_lens == (3 * 2**31, 2000, 2**33 + 1)
    assert layout.message_lens == (messages[0].nbytes, 3 * 2**31, 2**33 + 1)
    assert layout.separate == (0, 2)
    off = layout.offsets[1]
    assert off is not None
    assert bytes(messages[0][off : off + 2000]) == bytes(small)


class _MockWire:
    """A one-way transport: messages match in order and lengths must agree, as in plait's.

    Bytes are copied only for messages below ``copy_max``; above it both ends are
    untouched anonymous memory (all zeros), so the data agree without moving 2 GiB.
    """

    def __init__(self, copy_max: int = 1 << 20) -> None:
        self.queue: list[Any] = []
        self.copy_max = copy_max

    def send(self, data: Any) -> None:
        self.queue.append(data)

    def recv(self, into: memoryview) -> None:
        data = self.queue.pop(0)
        assert into.nbytes == data.nbytes, "a receive must be posted with the exact length"
        if data.nbytes <= self.copy_max:
            into[:] = data


def _anonymous(nbytes: int) -> memoryview:
    """``nbytes`` of zeroed memory that costs nothing until touched."""
    return memoryview(mmap.mmap(-1, nbytes))


def test_an_object_above_2_gib_goes_through_a_mocked_transport_without_a_copy() -> None:
    nbytes = 2**31 + 4096
    sent = np.frombuffer(_anonymous(nbytes), dtype=np.float64)
    wire = _MockWire()
    # sender: the size word, then the messages pack made, as send_object would
    messages = pack(dumps({"huge": sent, "note": "above 2 GiB"}), separate_min=SEPARATE_MIN)
    assert _address(messages[1]) == sent.ctypes.data  # the array's own memory, uncopied
    wire.send(np.array([messages[0].nbytes], dtype="<u8").data)
    for msg in messages:
        wire.send(msg)
    # receiver: size word, first message, then buffers sized from its table
    size = np.empty(1, dtype="<u8")
    wire.recv(size.data)
    first = empty(int(size[0]))
    wire.recv(first)
    layout = Layout.read(first, separate_min=SEPARATE_MIN)
    assert layout.buffer_lens == (nbytes,)
    rest = []
    for n in layout.message_lens[1:]:
        into = _anonymous(n)
        wire.recv(into)
        rest.append(into)
    out = loads(*unpack([first, *rest], separate_min=SEPARATE_MIN))
    assert out["note"] == "above 2 GiB"
    assert out["huge"].shape == (nbytes // 8,)
    assert out["huge"].dtype == np.float64
    assert out["huge"].ctypes.data == _address(rest[0])
    assert out["huge"][0] == 0
    assert out["huge"][-1] == 0


# -- malformed input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "fewer than the 16"),
        (struct.pack("<Q", 1), "fewer than the 16"),
        (struct.pack("<QQ", 3, 10) + struct.pack("<Q", 5), "lists 3 buffers"),
        (struct.pack("<QQ", 2**64 - 1, 10), "lists 18446744073709551615 buffers"),
        (struct.pack("<QQ", 0, 0), "pickle length of 0"),
    ],
    ids=["empty", "short", "truncated", "absurd-count", "no-pickle"],
)
def test_a_malformed_length_table_raises_a_clear_value_error(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        unpack_lengths(data)
    with pytest.raises(ValueError, match="malformed object"):
        unpack([data])


def test_a_first_message_of_the_wrong_length_is_refused() -> None:
    first = pack(dumps(np.arange(1000.0)))[0]
    with pytest.raises(ValueError, match="malformed object message"):
        Layout.read(first[:-ALIGN])
    with pytest.raises(ValueError, match="malformed object message"):
        Layout.read(bytes(first) + bytes(ALIGN))
    # both sides must agree on separate_min: a receiver that does not is told so
    big = pack(dumps(np.zeros(2 * SEPARATE_MIN, np.uint8)), separate_min=SEPARATE_MIN)
    with pytest.raises(ValueError, match="separate_min=None"):
        unpack(big)


def test_separate_messages_that_do_not_match_the_table_are_refused() -> None:
    n = 2 * SEPARATE_MIN
    messages = _receive(pack(dumps(np.zeros(n, np.uint8)), separate_min=SEPARATE_MIN))
    with pytest.raises(ValueError, match=rf"wants separate buffers of \[{n}\] bytes"):
        unpack(messages[:1], separate_min=SEPARATE_MIN)
    with pytest.raises(ValueError, match=rf"but \[{n - 1}\] arrived"):
        unpack([messages[0], messages[1][:-1]], separate_min=SEPARATE_MIN)
    with pytest.raises(ValueError, match="no messages"):
        unpack([])


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_lengths_outside_64_bits_are_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        pack_lengths(bad, [])
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        pack_lengths(10, [1, bad])


def test_pack_into_wants_exactly_the_first_message() -> None:
    frames = dumps(np.arange(1000.0))
    with pytest.raises(ValueError, match="pack_into"):
        pack_into(frames, empty(ALIGN))


def test_no_first_message_can_be_mistaken_for_the_failure_word() -> None:
    assert PICKLE_FAILED % ALIGN != 0
    assert PICKLE_FAILED == 2**64 - 1


# -- torch --------------------------------------------------------------------------------


def _torch() -> Any:
    return pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")


@pytest.mark.torch
@SPLITS
def test_torch_tensors_travel_out_of_band_and_arrive_as_the_received_memory(
    separate_min: int | None,
) -> None:
    torch = _torch()
    tensors = {
        "f32": torch.arange(SEPARATE_MIN // 2, dtype=torch.float32),  # 2 MiB
        "bf16": torch.linspace(0, 1, 5000).to(torch.bfloat16),
        "bool": torch.arange(3000) % 3 == 0,
        "c64": torch.randn(1000, dtype=torch.complex64),
        "i64_2d": torch.arange(6000).reshape(60, 100),
        "transposed": torch.randn(200, 30).t(),
        "view": torch.arange(60_000, dtype=torch.float64)[1000:3000],
        "zero_d": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "conj": torch.randn(500, dtype=torch.complex128).conj(),
    }
    frames = dumps(tensors)
    assert len(frames.header) < 2048, "tensor bytes must not be in the pickle"
    # a contiguous tensor's frame is its own memory
    f32 = frames.buffers[0]
    assert _address(f32) == tensors["f32"].data_ptr()
    # a view sends only its own bytes, not its storage's
    assert 2000 * 8 in frames.buffer_lens
    assert 60_000 * 8 not in frames.buffer_lens

    out, received = _round_trip(tensors, separate_min)
    for name, t in tensors.items():
        got = out[name]
        assert type(got) is torch.Tensor, name
        assert got.dtype == t.dtype, name
        assert got.shape == t.shape, name
        assert torch.equal(got, t.resolve_conj()), name
    # a tensor that was a message of its own arrives in that memory; one inside a larger
    # message is copied out of it, into storage of its own (Note [out-of-band buffers])
    bases = [_address(m) for m in received]
    ends = [b + m.nbytes for b, m in zip(bases, received, strict=True)]
    ptr = out["f32"].data_ptr()
    inside = any(b <= ptr < e for b, e in zip(bases, ends, strict=True))
    assert inside == (separate_min is not None)
    if separate_min is not None:
        assert ptr in bases
    for got in out.values():
        assert got.untyped_storage().nbytes() == got.nbytes  # its own, all of it


@pytest.mark.torch
@SPLITS
def test_sent_and_received_tensors_stay_resizable(separate_min: int | None) -> None:
    """Neither the sender's tensors nor the received ones end up with storage torch cannot
    resize: ``Tensor.numpy()`` marked the sender's so for good, and storage over received
    memory (``torch.from_numpy``) never is; FSDP frees parameters with
    ``storage.resize_(0)``."""
    torch = _torch()
    tensors = {
        "big": torch.arange(SEPARATE_MIN // 4 + 10, dtype=torch.float32),  # a message alone
        "small": torch.arange(2000, dtype=torch.int64),  # out of band, inside the first
        "tiny": torch.ones(3),  # in the pickle
        "bf16": torch.ones(1000, dtype=torch.bfloat16),
        "grad": torch.ones(700, requires_grad=True),
        "transposed": torch.arange(6000.0).reshape(60, 100).t(),
    }
    out, _ = _round_trip(tensors, separate_min)
    for name, t in [*tensors.items(), *(("received " + k, v) for k, v in out.items())]:
        plain = t.detach()
        n = plain.numel()
        plain.resize_(2 * n)  # raised "Trying to resize storage that is not resizable"
        storage = plain.untyped_storage()
        storage.resize_(0)
        storage.resize_(2 * n * plain.element_size())
        assert plain.shape == (2 * n,), name
    assert out["grad"].requires_grad


@pytest.mark.torch
def test_a_dense_tensor_keeps_its_strides_and_one_with_gaps_arrives_contiguous() -> None:
    """A channels_last or transposed tensor arrived contiguous (NCHW), where torch's own
    pickling keeps its layout; it is sent as it lies in memory now, with no copy."""
    torch = _torch()
    nhwc = torch.arange(2 * 3 * 16 * 16.0).reshape(2, 3, 16, 16)  # out of band: 6 KiB
    nhwc = nhwc.to(memory_format=torch.channels_last)
    tensors = {
        "channels_last": nhwc,
        "transposed": torch.arange(6000.0).reshape(60, 100).t(),
        "permuted_with_ones": torch.ones(3, 1, 2).transpose(0, 2),
        "every_other": torch.arange(5000.0)[::2],  # gaps: contiguous, its own bytes only
        "expanded": torch.arange(400.0).expand(3, 400),  # overlaps: contiguous
    }
    frames = dumps(tensors)
    assert _address(frames.buffers[0]) == nhwc.data_ptr()  # as it lies: no copy
    out, _ = _round_trip(tensors, None)
    for name, t in tensors.items():
        got = out[name]
        assert torch.equal(got, t), name
        if name in ("every_other", "expanded"):
            assert got.is_contiguous(), name
        else:
            assert got.stride() == t.stride(), name
    assert out["channels_last"].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.torch
def test_torch_parameters_and_requires_grad_survive() -> None:
    torch = _torch()
    param = torch.nn.Parameter(torch.randn(300, 10))
    leaf = torch.randn(500, requires_grad=True)
    out, _ = _round_trip({"p": param, "leaf": leaf, "plain": torch.ones(400)}, SEPARATE_MIN)
    assert isinstance(out["p"], torch.nn.Parameter)
    assert out["p"].requires_grad
    assert torch.equal(out["p"].detach(), param.detach())
    assert out["leaf"].requires_grad
    assert out["leaf"].is_leaf
    assert not out["plain"].requires_grad


@pytest.mark.torch
def test_tensors_plait_does_not_handle_keep_torchs_own_pickling() -> None:
    torch = _torch()
    tagged = torch.arange(1000.0)
    tagged.note = "kept"  # a Python attribute: torch's pickling carries it
    out, _ = _round_trip(tagged, SEPARATE_MIN)
    assert out.note == "kept"
    assert torch.equal(out, tagged)


@pytest.mark.torch
def test_a_read_only_received_buffer_gives_a_tensor_copy_without_warnings() -> None:
    torch = _torch()
    t = torch.arange(10_000, dtype=torch.int32)
    header, buffers = unpack(pack(dumps(t)))
    out = loads(bytes(header), [bytes(b) for b in buffers])
    assert torch.equal(out, t)


class _NoTorch(importlib.abc.MetaPathFinder):
    """Fails any import of torch."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] == "torch":
            raise ImportError(f"{fullname} imported; plait.objects must not import torch")
        return None


def test_the_module_never_imports_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch loaded, objects move without it (torch is looked up, never imported)."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoTorch(), *sys.meta_path])
    obj = {"x": np.ones(5000), "y": np.arange(3000.0)[::2], "s": "text"}
    for separate_min in (None, 4096):
        out, _ = _round_trip(obj, separate_min)
        _assert_same(out, obj)
    assert "torch" not in sys.modules


# -- the rank-order fold ------------------------------------------------------------------


def test_the_fold_runs_in_rank_order() -> None:
    assert reduce_in_rank_order(["a", "b", "c", "d"], operator.add) == "abcd"
    assert reduce_in_rank_order([[0], [1], [2]], operator.add) == [0, 1, 2]
    calls: list[tuple[str, str]] = []

    def concat(x: str, y: str) -> str:
        calls.append((x, y))
        return x + y

    assert reduce_in_rank_order(["r0", "r1", "r2"], concat) == "r0r1r2"
    assert calls == [("r0", "r1"), ("r0r1", "r2")]


def test_one_rank_folds_to_its_own_object() -> None:
    obj = {"only": 1}
    assert reduce_in_rank_order([obj], operator.add) is obj


def test_folding_nothing_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no objects"):
        reduce_in_rank_order([], operator.add)


def test_a_failing_op_names_itself_and_the_ranks() -> None:
    with pytest.raises(TypeError) as info:
        reduce_in_rank_order(["a", "b", 3, "d"], operator.add)
    note = "\n".join(info.value.__notes__)
    assert "operator.add" in note
    assert "the result of ranks 0..1 with rank 2's object (str with int)" in note

    def merge(x: dict[str, int], y: dict[str, int]) -> dict[str, int]:
        raise KeyError("clash")

    with pytest.raises(KeyError) as info2:
        reduce_in_rank_order([{"a": 1}, {"a": 2}], merge)
    note = "\n".join(info2.value.__notes__)
    assert "merge" in note
    assert "rank 0's object with rank 1's object" in note


def test_the_public_names_are_exported() -> None:
    assert set(objects.__all__) == {
        "ALIGN",
        "OOB_MIN",
        "PICKLE_FAILED",
        "SEPARATE_MIN",
        "Frames",
        "Layout",
        "dumps",
        "empty",
        "loads",
        "pack",
        "pack_into",
        "pack_lengths",
        "reduce_in_rank_order",
        "unpack",
        "unpack_lengths",
    }
