"""Turn a store URL (``tcp://``, ``file://``, ``redis://``) into a connected Store.

==================================  ================================================
URL                                 store
==================================  ================================================
``tcp://host:port``                 :class:`~plait.rendezvous.tcp_store.TCPStore`;
                                    ``is_server=True`` also starts the server here
``tcp://[::1]:port``                the same over IPv6 (literal in brackets)
``file:///abs/path``                :class:`~plait.rendezvous.file_store.FileStore`
``redis://host[:port][/db]``        :class:`~plait.rendezvous.redis_store.RedisStore`
                                    (port 6379, db 0 by default; ``?prefix=job7/``)
``redis://[user][:pass]@host...``   the same, authenticating (``requirepass``: no
                                    user; a Redis 6 ACL user: both), as redis-py's
                                    ``from_url``; %-escape ``@ : /`` in them
==================================  ================================================

A password is never shown: error messages print the URL with ``***`` in its place.
"""

from __future__ import annotations

import difflib
import os
import urllib.parse

from plait.errors import RendezvousError
from plait.rendezvous.store import DEFAULT_STORE_TIMEOUT, Store

__all__ = ["SCHEMES", "store_from_url"]

#: Schemes :func:`store_from_url` understands, each with its URL shape.
SCHEMES = {
    "tcp": "tcp://host:port",
    "file": "file:///absolute/path",
    "redis": "redis://[[user]:password@]host[:port][/db]",
}
_REDIS_PORT = 6379


def store_from_url(
    url: str,
    *,
    rank: int = 0,
    is_server: bool | None = None,
    timeout: float | None = None,
) -> Store:
    """The store ``url`` names, connected.

    Args:
        url: ``tcp://host:port``, ``tcp://[v6addr]:port``, ``file:///abs/path``
            or ``redis://[[user]:password@]host[:port][/db][?prefix=...]``.
        rank: This process's rank; named in error messages.
        is_server: For ``tcp://`` only: start the store server in this process
            on ``host:port`` (port 0 picks a free one) and return a client that
            owns it. None means False: the caller decides which process serves
            (usually the launcher, or rank 0). Ignored by other schemes.
        timeout: Default seconds for blocking store calls, and for a ``tcp://``
            client to keep trying to connect; None: ``DEFAULT_STORE_TIMEOUT``.

    Returns:
        The connected store; close it when done.

    Raises:
        ValueError: the URL is malformed or its scheme unknown.
        RendezvousError: the store cannot be reached (the message names ``rank``).
        ImportError: ``redis://`` without the ``redis`` package.
    """
    seconds = DEFAULT_STORE_TIMEOUT if timeout is None else timeout
    parts = _split(url)
    shown = _masked(url, parts)  # what messages print: never the password
    try:
        if parts.scheme == "tcp":
            return _tcp(shown, parts, is_server=bool(is_server), timeout=seconds)
        if parts.scheme == "file":
            return _file(shown, parts, timeout=seconds)
        return _redis(shown, parts, timeout=seconds)
    except RendezvousError as exc:
        raise type(exc)(f"rank {rank}: {exc}") from exc


def _split(url: str) -> urllib.parse.SplitResult:
    if not isinstance(url, str):
        raise TypeError(f"store URL must be a str, got {type(url).__name__}: {url!r}")
    supported = ", ".join(SCHEMES.values())
    if "://" not in url:
        scheme, _, rest = url.partition(":")
        guess = f"file:///absolute/{rest.lstrip('/')}" if scheme == "file" else f"tcp://{url}"
        raise ValueError(
            f"store URL {url!r} has no scheme; supported: {supported}. Did you mean '{guess}'?"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in SCHEMES:
        close = difflib.get_close_matches(parts.scheme, SCHEMES, n=1, cutoff=0.5)
        hint = f" Did you mean '{close[0]}://'?" if close else ""
        raise ValueError(
            f"unknown store URL scheme {parts.scheme!r} in {_masked(url, parts)!r}; "
            f"supported: {supported}.{hint}"
        )
    return parts


def _masked(url: str, parts: urllib.parse.SplitResult) -> str:
    """``url`` with its password, if any, as ``***``: for messages."""
    if parts.password is None:
        return url
    user, _, _ = parts.netloc.rpartition("@")[0].partition(":")
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _host_port(url: str, parts: urllib.parse.SplitResult) -> tuple[str | None, int | None]:
    try:
        return parts.hostname, parts.port
    except ValueError as exc:  # a port that is not a number in 0..65535
        raise ValueError(f"store URL {url!r}: {exc}") from None


def _no_extras(url: str, parts: urllib.parse.SplitResult, shape: str) -> None:
    if parts.username or parts.password or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"store URL {url!r} has parts a store does not use; expected {shape}")


def _tcp(url: str, parts: urllib.parse.SplitResult, *, is_server: bool, timeout: float) -> Store:
    from plait.rendezvous.tcp_store import TCPStore

    host, port = _host_port(url, parts)
    if not host or port is None:
        raise ValueError(f"store URL {url!r} needs a host and a port: {SCHEMES['tcp']}")
    _no_extras(url, parts, SCHEMES["tcp"])
    if parts.query:
        raise ValueError(f"store URL {url!r}: tcp:// takes no query, got {parts.query!r}")
    if port == 0 and not is_server:
        raise ValueError(f"store URL {url!r}: port 0 only makes sense with is_server=True")
    return TCPStore.create(host, port, is_server=is_server, timeout=timeout)


def _file(url: str, parts: urllib.parse.SplitResult, *, timeout: float) -> Store:
    from plait.rendezvous.file_store import FileStore

    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ValueError(
            f"store URL {url!r} needs an absolute path: {SCHEMES['file']} "
            "(three slashes: file:// then /path)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"store URL {url!r}: file:// takes no query or fragment")
    path = urllib.parse.unquote(parts.path)
    if os.path.normpath(path) == os.path.sep:  # keys would be files in /, cleanup would empty it
        raise ValueError(
            f"store URL {url!r} names the root directory; give a directory of its own: "
            f"{SCHEMES['file']}"
        )
    return FileStore(path, timeout=timeout)


def _redis(url: str, parts: urllib.parse.SplitResult, *, timeout: float) -> Store:
    from plait.rendezvous.redis_store import RedisStore

    host, port = _host_port(url, parts)
    if not host:
        raise ValueError(f"store URL {url!r} needs a host: {SCHEMES['redis']}")
    db_text = parts.path.strip("/")
    if not (db_text.isascii() and db_text.isdigit()) and db_text != "":
        raise ValueError(f"store URL {url!r}: the database must be a number, got {db_text!r}")
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"prefix"})
    if unknown or parts.fragment:
        what = f"query parameters {unknown}" if unknown else "a fragment"
        raise ValueError(f"store URL {url!r}: redis:// takes only ?prefix=..., got {what}")
    kwargs: dict[str, str] = {}
    if "prefix" in query:
        kwargs["prefix"] = query["prefix"][-1]
    # As redis-py's from_url: %-escapes undone, an empty user or password is none.
    if parts.username:
        kwargs["username"] = urllib.parse.unquote(parts.username)
    if parts.password:
        kwargs["password"] = urllib.parse.unquote(parts.password)
    return RedisStore(
        host,
        _REDIS_PORT if port is None else port,
        db=int(db_text or 0),
        timeout=timeout,
        **kwargs,
    )
