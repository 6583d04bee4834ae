"""Shared-memory names nobody else can take, peers of other users refused, nothing left behind.

See ``docs/transport.md``, Note [segment names] and Note [lifetime and cleanup].
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shm_helpers import Stranger, in_threads

from plait.errors import TransportError
from plait.rendezvous.store import MemoryStore
from plait.transport.shm import ShmTransport, hellos, segment, sockets
from plait.transport.shm.ring import segment_bytes

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as nobody")


@pytest.fixture(autouse=True)
def no_leftovers(own_segments: list[str]) -> Iterator[None]:
    """No segment of this test stays in /dev/shm (see conftest.py), no thread runs on."""
    threads = set(threading.enumerate())
    yield
    assert [t for t in threading.enumerate() if t not in threads and t.is_alive()] == []


def _job() -> str:
    return f"names-{os.getpid()}-{secrets.token_hex(4)}"  # unique: other runs may be going on


def _pair(store: MemoryStore, job: str) -> list[ShmTransport]:
    """Ranks 0 and 1 of ``job`` on threads; both must come up."""
    out: dict[int, object] = {}

    def build(rank: int) -> None:
        try:
            out[rank] = ShmTransport(rank, 2, store, timeout=20, job=job)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    made = [x for x in out.values() if isinstance(x, ShmTransport)]
    if len(made) < 2:
        for t in made:
            t.close()
        pytest.fail(f"init failed: {out}")
    return [out[0], out[1]]  # type: ignore[list-item]


def _exchange(ts: list[ShmTransport]) -> None:
    src, dst = np.arange(16, dtype=np.uint8), np.zeros(16, np.uint8)
    r = ts[1].irecv(0, 7, dst.data.cast("B"), 0)
    s = ts[0].isend(1, 7, src.data.cast("B"), 0)
    assert ts[0].wait_any([s], 20)
    assert ts[1].wait_any([r], 20)
    assert r.error is None
    assert s.error is None
    assert dst.tolist() == src.tolist()


def test_squatted_predictable_names_do_not_break_init() -> None:
    """Files and sockets made first under the names derived from the job id alone."""
    job = _job()
    squatted = [f"/dev/shm/plait-{job}-g1-{r}" for r in (0, 1)]
    socks: list[socket.socket] = []
    try:
        for path in squatted:
            Path(path).touch(mode=0o644)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(s)
            s.bind("\0" + os.path.basename(path))
            s.listen(4)
        ts = _pair(MemoryStore(timeout=20), job)
        try:
            _exchange(ts)
        finally:
            for t in ts:
                t.close()
    finally:
        for s in socks:
            s.close()
        for path in squatted:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# Children start as root and drop to nobody once Python is loaded (the interpreter may
# live where nobody cannot read it).
_AS_NOBODY = (
    f"import os, socket, struct, sys\nos.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
)

_HOLD = _AS_NOBODY + textwrap.dedent(
    """
    import socket, sys
    socks = []
    for name in sys.argv[1:]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\\0" + name)
        s.listen(4)
        socks.append(s)
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    """
)


@contextlib.contextmanager
def _held_by_nobody(*names: str) -> Iterator[None]:
    """Abstract Unix sockets ``names`` bound and listening in a process of uid 65534."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD, *names],
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        yield
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
        assert child.stdout is not None
        child.stdout.close()


@as_root
def test_a_peer_socket_of_another_user_is_refused() -> None:
    """Rank 1 finds rank 0's announced socket held by uid 65534: a clear error, at once."""
    job, tail = _job(), secrets.token_hex(8)
    store = MemoryStore(timeout=20)
    store.set("plait-shm/generation/0", b"1")
    store.set("plait-shm/1/job", job.encode())
    store.set("plait-shm/1/ready/0", f"{tail}:{segment_bytes(2, 2, 4096)}".encode())
    # Also the name the job id alone once gave, so that the old scheme meets it too.
    with (
        _held_by_nobody(f"plait-{job}-g1-0-{tail}", f"plait-{job}-g1-0"),
        pytest.raises(TransportError, match=f"uid {NOBODY}, not of this user") as info,
    ):
        ShmTransport(1, 2, store, timeout=20, job=job, slots=2, slot_bytes=4096)
    assert f"@plait-{job}-g1-0-{tail}" in str(info.value)


_INTRUDE = _AS_NOBODY + textwrap.dedent(
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\\0" + sys.argv[1])
    s.sendall(struct.pack("<Q16s", 1, sys.argv[2].encode()[:16].ljust(16, b"\\0")))
    print("connected", flush=True)
    s.settimeout(20)
    try:
        got = s.recv(1)
    except ConnectionResetError:  # closed with our hello unread
        got = b""
    print("dropped" if got == b"" else "answered", flush=True)
    """
)


@as_root
def test_a_connection_from_another_user_is_dropped() -> None:
    """A process of uid 65534 with the right hello, ahead of rank 1, cannot take its place."""
    job = _job()
    store = MemoryStore(timeout=20)
    out: dict[int, object] = {}

    def build(rank: int) -> None:
        try:
            out[rank] = ShmTransport(rank, 2, store, timeout=20, job=job)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    threads[0].start()
    try:
        tail = store.get("plait-shm/1/ready/0", 20).decode().partition(":")[0]
        with subprocess.Popen(
            [sys.executable, "-c", _INTRUDE, f"plait-{job}-g1-0-{tail}", job],
            cwd="/",
            stdout=subprocess.PIPE,
            text=True,
        ) as intruder:
            assert intruder.stdout is not None
            assert intruder.stdout.readline() == "connected\n"  # queued before rank 1
            threads[1].start()
            assert intruder.stdout.readline() == "dropped\n"
    finally:
        for t in threads:
            if t.ident is not None:
                t.join(30)
    made = [out[r] for r in (0, 1) if isinstance(out.get(r), ShmTransport)]
    try:
        assert len(made) == 2, out
        _exchange(made)
    finally:
        for t in made:
            t.close()


def test_a_segment_that_is_not_what_was_announced_is_refused(tmp_path: Path) -> None:
    nbytes = segment.CONTROL_BYTES * 2

    def handed(mode: int, size: int, uid: int | None = None) -> int:
        path = tmp_path / f"seg-{mode:o}-{size}-{uid}"
        path.write_bytes(b"\0" * size)
        path.chmod(mode)
        if uid is not None:
            os.chown(path, uid, -1)
        return os.open(path, os.O_RDWR)

    with pytest.raises(TransportError, match="refusing segment /x: it is accessible by other"):
        segment.attach(handed(0o644, nbytes), "/x", nbytes, 3)
    with pytest.raises(TransportError, match=f"it has {nbytes - 8} bytes, its rank announced"):
        segment.attach(handed(0o600, nbytes - 8), "/x", nbytes, 3)
    if os.geteuid() == 0:
        with pytest.raises(TransportError, match=f"it belongs to uid {NOBODY}"):
            segment.attach(handed(0o600, nbytes, NOBODY), "/x", nbytes, 3)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    fd = os.open(fifo, os.O_RDWR)
    with pytest.raises(TransportError, match="it is not a regular file"):
        segment.attach(fd, "/x", nbytes, 3)
    seg = segment.attach(handed(0o600, nbytes), "/x", nbytes, 3)  # a good one maps
    seg.release()


_KILLED_IN_SETUP = textwrap.dedent(
    """
    import os, signal, sys
    from plait.rendezvous.store import MemoryStore
    from plait.transport.shm import ShmTransport

    class Store(MemoryStore):
        def set(self, key, value):
            super().set(key, value)
            if "/ready/" in key:  # segment made, peers about to look for it: die here
                os.kill(os.getpid(), signal.SIGKILL)

    ShmTransport(0, 2, Store(timeout=30), timeout=30, job=sys.argv[1])
    """
)


def test_a_rank_killed_during_setup_leaves_nothing_in_dev_shm() -> None:
    """SIGKILL right after announcing its segment, outside ``plait run`` (no cleanup)."""
    _killed_leaves_nothing(_KILLED_IN_SETUP)


def _killed_leaves_nothing(script: str) -> None:
    """Run ``script`` (given a job id), which kills itself: nothing of the job stays."""
    job = _job()
    try:
        child = subprocess.run([sys.executable, "-c", script, job], capture_output=True, timeout=60)
        assert child.returncode == -9, child
        assert glob.glob(f"/dev/shm/plait-{job}-*") == []
    finally:
        for path in glob.glob(f"/dev/shm/plait-{job}-*"):
            os.unlink(path)


_KILLED_MAKING_ITS_SEGMENT = textwrap.dedent(
    """
    import os, signal, sys
    from plait.rendezvous.store import MemoryStore
    from plait.transport.shm import ShmTransport

    def fallocate(fd, offset, length):  # the segment's file is open, its memory not reserved
        os.kill(os.getpid(), signal.SIGKILL)

    os.posix_fallocate = fallocate
    ShmTransport(0, 2, MemoryStore(timeout=30), timeout=30, job=sys.argv[1])
    """
)


def test_a_rank_killed_while_making_its_segment_leaves_nothing_in_dev_shm() -> None:
    """SIGKILL between creating the segment's file and mapping it (reserving and mapping a
    large window takes milliseconds): the file never had a name in /dev/shm."""
    _killed_leaves_nothing(_KILLED_MAKING_ITS_SEGMENT)


_TELL = _AS_NOBODY + textwrap.dedent(
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\\0" + sys.argv[1])
    token = sys.argv[2].encode()[:16].ljust(16, b"\\0")
    s.sendall(struct.pack("<Q16sQ", 0, token, 0) + b"Fspoofed: run this to fix it")
    s.settimeout(20)
    try:
        got = s.recv(4096)
    except ConnectionResetError:
        got = b""
    print(repr(got), flush=True)
    """
)


@as_root
def test_a_failing_set_up_neither_reads_nor_tells_another_users_connection() -> None:
    """Where set-up fails, a rank reads why a peer broke off from connections queued on its
    listener, and tells them why it gives up: a process of another user, with the public
    token, set the text of a rank's error and read another's."""
    from types import SimpleNamespace

    from plait.transport.shm import bootstrap

    name = f"plait-{_job()}-g1-0-{secrets.token_hex(8)}"
    token = "tok" + secrets.token_hex(4)
    for what in ("told", "break_off"):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + name)
        listener.listen(4)
        join: Any = SimpleNamespace(
            listener=listener,
            token=token.encode()[:16].ljust(16, b"\0"),
            nonce=0,
            names=[0, 1],
            size=2,
            me=1,
            hello=b"x" * bootstrap._HELLO.size,
            wires=[],
            hellos=hellos.Hellos(listener, 1, lambda pid: False),
            _close_listener=listener.close,
        )
        with subprocess.Popen(
            [sys.executable, "-c", _TELL, name, token], cwd="/", stdout=subprocess.PIPE, text=True
        ) as intruder:
            assert intruder.stdout is not None
            deadline = time.monotonic() + 20
            while not _queued(name) and time.monotonic() < deadline:
                time.sleep(0.01)  # until its connection waits on the listener
            if what == "told":
                assert bootstrap._Join._told(join) is None
            else:
                bootstrap._Join.break_off(join, RuntimeError("secret reason"))
            listener.close()
            assert intruder.stdout.readline() == "b''\n"


def _queued(name: str) -> bool:
    """Whether a connection to abstract socket ``name`` waits to be accepted."""
    with open("/proc/net/unix") as f:  # a connected client's line names the socket too
        return sum(line.rstrip().endswith("@" + name) for line in f) >= 2


def _full_queue(name: str) -> tuple[socket.socket, list[socket.socket]]:
    """A listener on ``name`` with the shortest queue, filled by connections never accepted."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(0)
    queued = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect("\0" + name)
        except BlockingIOError:
            s.close()
            return listener, queued
        queued.append(s)


def test_a_full_queue_is_waited_for_and_named_when_it_stays_full() -> None:
    """Note [a queue others fill]: another user who kept a rank's queue full made every
    connect to it fail at once with EAGAIN ("Resource temporarily unavailable")."""
    name = f"plait-test-{secrets.token_hex(6)}"
    listener, queued = _full_queue(name)
    try:
        drain = threading.Timer(0.3, lambda: [listener.accept()[0].close() for _ in queued])
        drain.start()
        sock = sockets.connect(name, 10, lambda: None, "rank 1")
        sock.close()
        drain.join()
    finally:
        listener.close()
        for s in queued:
            s.close()
    listener, queued = _full_queue(name)
    try:
        start = time.monotonic()
        with pytest.raises(TransportError, match=r"rank 1: the queue of @plait-test-\w+ stayed"):
            sockets.connect(name, 0.3, lambda: None, "rank 1")
        assert time.monotonic() - start < 5
    finally:
        listener.close()
        for s in queued:
            s.close()


def test_a_ranks_queue_holds_more_than_its_peers() -> None:
    """The queue was as long as the ranks (2): three connections filled it."""
    name = f"plait-test-{secrets.token_hex(6)}"
    listener = sockets.listen(name, 2)
    queued = []
    try:
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            queued.append(s)
            s.setblocking(False)
            s.connect("\0" + name)  # BlockingIOError where the queue is full
    finally:
        listener.close()
        for s in queued:
            s.close()


#: What a stranger sends before it falls silent: nothing, or the first bytes of a hello.
_JUNK = {"silent": b"", "part of a hello": b"\x01\x00\x00\x00\x00\x00\x00\x00plait"}
_STRANGERS = pytest.mark.parametrize("junk", list(_JUNK))
_WHERE = pytest.mark.parametrize("where", ["another process", "this process"])


@_STRANGERS
@_WHERE
def test_init_is_not_held_up_by_a_connection_that_says_nothing(
    monkeypatch: pytest.MonkeyPatch, where: str, junk: str
) -> None:
    """A process of this user connected to rank 0's socket ahead of rank 1 and fell silent:
    rank 0 read its hello with a blocking read under the whole deadline, so both ranks
    failed after their timeout (rank 1 "did not connect", rank 0 "was silent")."""
    from plait.transport.shm import bootstrap

    job = _job()
    stranger = Stranger(where, _JUNK[junk])
    listen = bootstrap.listen

    def listen_and_knock(name: str, backlog: int) -> socket.socket:
        listener = listen(name, backlog)
        if name.startswith(f"plait-{job}-g1-0-"):
            stranger.connect(name)  # queued ahead of rank 1's connection
        return listener

    monkeypatch.setattr(bootstrap, "listen", listen_and_knock)
    store = MemoryStore(timeout=30)
    try:
        start = time.monotonic()
        ts = in_threads([partial(ShmTransport, r, 2, store, timeout=30, job=job) for r in (0, 1)])
        took = time.monotonic() - start
        try:
            _exchange(ts)
        finally:
            for t in ts:
                t.close()
        assert took < 15  # not the timeout's 30 s
        assert stranger.dropped()
    finally:
        stranger.close()


def test_a_silent_connection_is_dropped_after_its_time_and_holds_up_nobody(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Note [silent connections]: a stranger gets HANDSHAKE_SECONDS for its hello, and the
    hellos of connections behind it are read meanwhile."""
    monkeypatch.setattr(hellos, "HANDSHAKE_SECONDS", 0.3)
    name = f"plait-test-{secrets.token_hex(6)}"
    listener = sockets.listen(name, 2)
    waiting = hellos.Hellos(listener, 1, lambda pid: False)
    silent, partial_hello, rank = (socket.socket(socket.AF_UNIX) for _ in range(3))
    accepted: list[socket.socket] = []
    try:
        for s in (silent, partial_hello, rank):
            s.connect("\0" + name)
        partial_hello.sendall(b"\x01\x02")
        rank.sendall(b"h" * 32)
        said: list[bytes] = []
        deadline = time.monotonic() + 20
        while not said and time.monotonic() < deadline:
            for sock in waiting.wait(1.0):
                if sock is listener:
                    waiting.accept()
                elif (hello := waiting.read(sock, 32)) is not None:
                    said.append(hello)
                    accepted.append(sock)
        assert said == [b"h" * 32]
        assert len(waiting) == 2  # the two strangers, still within their time
        while len(waiting) and time.monotonic() < deadline:
            assert waiting.wait(1.0) == []  # they say nothing more, and are dropped
        assert len(waiting) == 0
        for s in (silent, partial_hello):
            s.settimeout(10)
            assert s.recv(1) == b""
    finally:
        for c in waiting.close():
            c.close()
        for c in accepted:
            c.close()
        for s in (silent, partial_hello, rank):
            s.close()
        listener.close()


def test_at_most_a_cap_of_connections_wait_for_their_hello(monkeypatch: pytest.MonkeyPatch) -> None:
    """One more than the cap drops the oldest (Note [unauthenticated connections])."""
    monkeypatch.setattr(hellos, "MAX_UNAUTHENTICATED", 2)
    name = f"plait-test-{secrets.token_hex(6)}"
    listener = sockets.listen(name, 2)
    waiting = hellos.Hellos(listener, 1, lambda pid: True)
    socks = [socket.socket(socket.AF_UNIX) for _ in range(3)]
    try:
        for s in socks:
            s.connect("\0" + name)
        while waiting.accept():  # a cap's worth at a time
            pass
        assert len(waiting) == 2
        socks[0].settimeout(10)
        assert socks[0].recv(1) == b""  # the oldest
        for s in socks[1:]:
            with pytest.raises(BlockingIOError):
                s.recv(1, socket.MSG_DONTWAIT)  # still open
    finally:
        for c in waiting.close():
            c.close()
        for s in socks:
            s.close()
        listener.close()


def test_a_silent_connection_does_not_hide_why_a_peer_broke_off() -> None:
    """A rank that fails reads why a peer gave up from the connections queued on its
    listener: one that said nothing, ahead of the peer's, was read first, with a blocking
    read that gave up after a second, and the peer's words were never read."""
    from types import SimpleNamespace

    from plait.transport.shm import bootstrap

    name = f"plait-{_job()}-g1-0-{secrets.token_hex(8)}"
    token = b"tok".ljust(16, b"\0")
    listener = sockets.listen(name, 2)
    join: Any = SimpleNamespace(
        listener=listener,
        hellos=hellos.Hellos(listener, 1, lambda pid: False),
        token=token,
        nonce=7,
        names=[0, 1],
        size=2,
        me=0,
    )
    silent, teller = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    try:
        silent.connect("\0" + name)
        silent.sendall(b"\x01")
        teller.connect("\0" + name)
        teller.sendall(bootstrap._HELLO.pack(1, token, 7) + b"Fit ran out of memory")
        start = time.monotonic()
        told = bootstrap._Join._told(join)
        assert time.monotonic() - start < 10
        assert told is not None
        assert "rank 1 broke off" in str(told)
        assert "it ran out of memory" in str(told)
    finally:
        for c in join.hellos.close():
            c.close()
        silent.close()
        teller.close()
        listener.close()
