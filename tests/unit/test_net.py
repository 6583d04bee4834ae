"""``plait._net``: addresses as text, interface lists, local addresses, listening and connecting."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from plait import _net


@pytest.mark.parametrize(
    ("host", "port", "text"),
    [
        ("127.0.0.1", 29400, "127.0.0.1:29400"),
        ("node-3.cluster", 1, "node-3.cluster:1"),
        ("::1", 80, "[::1]:80"),
        ("[::1]", 80, "[::1]:80"),  # already bracketed: not twice
        ("fe80::1", 0, "[fe80::1]:0"),
    ],
)
def test_an_address_written_reads_back(host: str, port: int, text: str) -> None:
    assert _net.format_address(host, port) == text
    assert _net.parse_address(text) == (_net.strip_brackets(host), port)


@pytest.mark.parametrize("text", ["127.0.0.1", "host:", "host:http", "[::1]", ""])
def test_an_address_without_a_port_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="malformed TCP address"):
        _net.parse_address(text)


def test_brackets_and_families() -> None:
    assert _net.strip_brackets("[::1]") == "::1"
    assert _net.strip_brackets("::1") == "::1"
    assert _net.strip_brackets("[half") == "[half"
    assert _net.family("::1") == socket.AF_INET6
    assert _net.family("10.0.0.1") == socket.AF_INET


def test_resolve_gives_a_numeric_address() -> None:
    assert _net.resolve(" 127.0.0.1 ") == "127.0.0.1"
    assert _net.resolve("localhost") in ("127.0.0.1", "::1")


def test_interface_lists() -> None:
    assert _net.parse_ifname(" ^=lo,docker ") == _net.IfnameSpec(("lo", "docker"), True, True)
    names = ["lo", "eth0", "eth10", "docker0", "ib0"]
    assert _net.match_ifnames("eth", names) == ["eth0", "eth10"]
    assert _net.match_ifnames("=eth1", names) == []
    assert _net.match_ifnames("^docker,lo", names) == ["eth0", "eth10", "ib0"]
    for empty in ("", "^", "=,", " , "):
        with pytest.raises(ValueError, match="names no interface"):
            _net.parse_ifname(empty)


def test_the_loopback_interface_and_routes_to_local_hosts() -> None:
    assert "127.0.0.1" in _net.interface_addresses("lo")
    assert _net.select_interface_address("=lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="interfaces here"):
        _net.select_interface_address("=no-such-interface0")
    assert _net.route_to("127.0.0.5") == "127.0.0.1"
    assert _net.route_to("0.0.0.0") == "127.0.0.1"


def test_listen_prepares_before_binding_and_connect_sets_nodelay() -> None:
    seen: list[tuple[str, int]] = []
    listener = _net.listen(
        "127.0.0.1", 0, backlog=4, prepare=lambda s: seen.append(s.getsockname())
    )
    with listener:
        assert seen == [("0.0.0.0", 0)]  # not bound yet when prepared
        assert not listener.getblocking()
        port = listener.getsockname()[1]
        with _net.connect("127.0.0.1", port, 5.0) as sock:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_connect_retries_until_something_listens() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    port = server.getsockname()[1]
    got: list[socket.socket | BaseException] = []
    refused = threading.Event()

    def dial() -> None:
        try:
            with _net.connect("127.0.0.1", port, 0.0):  # one attempt: refused
                pass
        except OSError:
            refused.set()
        try:
            got.append(_net.connect("127.0.0.1", port, 60.0))
        except OSError as exc:
            got.append(exc)

    with server:
        thread = threading.Thread(target=dial)
        thread.start()
        assert refused.wait(30)
        server.listen(1)
        thread.join(60)
        (sock,) = got
        assert isinstance(sock, socket.socket), sock
        sock.close()


def test_connect_gives_up_with_the_last_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            _net.connect("127.0.0.1", port, 0.0)


def test_no_connection_attempt_takes_the_whole_patience(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store flooded with connections drops SYNs, and the kernel resends one only after
    1, 3, 7 s: one attempt given the whole patience lost it to the first dropped SYN."""
    given: list[float] = []

    def dropped(address: Any, timeout: float) -> socket.socket:
        given.append(timeout)
        if len(given) < 3:
            raise TimeoutError("timed out")
        return socket.socket()

    monkeypatch.setattr(socket, "create_connection", dropped)
    _net.connect("127.0.0.1", 1, 20.0).close()
    assert len(given) == 3
    assert max(given) <= _net._MAX_ATTEMPT


def test_a_store_that_answers_nothing_is_not_said_to_be_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It said "within 19.999998352002876 s (timed out); is it running, and is the
    address right?" of a running store that a flood kept from answering."""
    from plait.rendezvous.tcp_store import StoreConnectError, TCPStore

    def silent(host: str, port: int, patience: float) -> Any:
        raise TimeoutError("timed out")

    monkeypatch.setattr(_net, "connect", silent)
    store = TCPStore.__new__(TCPStore)
    store.host, store.port, store.address = "127.0.0.1", 1, "127.0.0.1:1"
    with pytest.raises(StoreConnectError) as info:
        store._connect(19.999998352002876)
    assert "within 20 s (timed out); nothing answered: it may be flooded" in str(info.value)
