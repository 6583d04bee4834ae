"""A rank that exits without closing delivers what it sent (Note [exit without close] in
plait.transport.tcp.link).

Rank 1, in a child process, sends rank 0 a striped message and exits without closing, most
of the message still in its kernel (rank 0 reads nothing meanwhile). Rank 0 then sends it a
small message, as a stalled call's probe does, and reads. Before, the child exited at
once, and its kernel answered that message with a reset and dropped the rest of the striped
message: rank 0's receive failed with PeerLostError though rank 1 had sent it all. Now the
child waits at its exit until its bytes have arrived.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from tcp_helpers import no_leaks  # noqa: F401 (fixture)

from plait.transport.conformance import wait_all
from plait.transport.tcp import CLOSE_FLUSH_SECONDS, TcpTransport

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("no_leaks"),
]

NBYTES = 4 << 20  # striped, and far more than rank 0's shrunken socket buffers hold

CHILD = textwrap.dedent(
    f"""
    import socket
    import sys
    import numpy as np
    from plait.rendezvous.tcp_store import TCPStore
    from plait.transport.tcp import CLOSE_FLUSH_SECONDS, TcpTransport

    store = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=30)
    t = TcpTransport(1, 2, store, timeout=30, streams=2)
    for c in t._link.peers[0].conns:  # the kernel takes the whole message (a send is done)
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, {NBYTES})
    data = np.arange({NBYTES}, dtype=np.uint32).astype(np.uint8)
    h = t.isend(0, 1, data.data, 0)
    while not h.done:
        t.wait_any([h], 30)
    assert h.error is None, h.error
    print("sent", flush=True)
    # the script ends here: no close
    """
)


@pytest.fixture
def store_server() -> Iterator[tuple[int, object]]:
    tcp_store = pytest.importorskip("plait.rendezvous.tcp_store")
    server = tcp_store.TCPStoreServer("127.0.0.1", 0)
    client = tcp_store.TCPStore("127.0.0.1", server.port, timeout=30)
    try:
        yield server.port, client
    finally:
        client.close()
        server.close()


def test_a_rank_that_exits_without_closing_delivers_its_last_message(
    store_server: tuple[int, object],
) -> None:
    port, store = store_server
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sent = threading.Event()

    def watch() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            if line.strip() == "sent":
                sent.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    t = None
    try:
        t = TcpTransport(0, 2, store, timeout=30, streams=2)  # type: ignore[arg-type]
        peer = t._link.peers[1]
        assert peer is not None
        for c in peer.conns:  # rank 0's kernel takes little of the message unread
            assert c.sock is not None
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        for _ in range(3000):  # until the announcement waits here (nothing else comes)
            if (1, 1) in t._unexpected:
                break
            t.wait_any([], 0.01)
        assert (1, 1) in t._unexpected, "rank 1 never announced its message"
        got = np.zeros(NBYTES, np.uint8)
        r = t.irecv(1, 1, got.data, 0)  # answers it (CTS) at once; rank 0 reads no more
        assert not peer.conns[0].sendq
        if not sent.wait(60):
            child.kill()
            pytest.fail(f"rank 1 never sent all of its message: {child.communicate()[1]}")
        probe = t.isend(1, 2, np.zeros(8, np.uint8).data, 0)
        # Rank 0 reads nothing yet: rank 1, its script over, waits for its bytes to arrive
        # (up to CLOSE_FLUSH_SECONDS) instead of leaving them to a kernel that resets.
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(CLOSE_FLUSH_SECONDS / 2)
        wait_all(t, [r, probe], timeout=60)
        assert r.error is None, r.error
        np.testing.assert_array_equal(got, np.arange(NBYTES, dtype=np.uint32).astype(np.uint8))
        assert child.wait(60) == 0, child.stderr.read()
    finally:
        if t is not None:
            t.close()
        if child.poll() is None:
            child.kill()
        child.wait(30)
        watcher.join(30)
        for pipe in (child.stdout, child.stderr):
            assert pipe is not None
            pipe.close()
