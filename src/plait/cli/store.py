r"""Serve the built-in rendezvous store until stopped (Ctrl-C or SIGTERM).

Ranks started by hand, or by a launcher plait does not know, meet through it when
each is given PLAIT_STORE=tcp://HOST:PORT. Run apart from the ranks, it outlives any
of them, so that the survivors of a lost rank can still agree and shrink. Clients
must know PLAIT_SECRET when it is set here; without one the store is open to anyone
who can reach the port, and says so when it listens beyond loopback.

Example:
  PLAIT_SECRET=s3cret plait store --host 0.0.0.0 --port 29600
  # then on each host, for each of its ranks r (0 to 3 in all):
  PLAIT_STORE=tcp://host0:29600 PLAIT_SECRET=s3cret PLAIT_RANK=r PLAIT_SIZE=4 \
      python train.py
"""

# The docstring above is `plait store --help`: plain text, no reStructuredText markup,
# and raw, so that the example's backslash ends its line there as in a shell (in a plain
# string it joined the two lines into one).

from __future__ import annotations

import argparse
import signal
import sys

__all__ = ["add_arguments", "main"]

#: Hosts that listen on every interface: the URL to give the ranks names this host instead.
_ANY_HOST = ("0.0.0.0", "::", "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``plait store``."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=int, default=0, help="port to listen on (default 0: a free one, printed)"
    )


def main(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; print the store's URL first."""
    from plait.errors import RendezvousError
    from plait.rendezvous.tcp_store import TCPStoreServer

    if not 0 <= args.port <= 65535:
        args._parser.error(f"--port {args.port} is not a port; expected 0..65535")
    # Blocked in every thread (the server's inherits the mask), so that they wait for
    # sigwait below: a handler's signal that reached the server's thread left the main
    # thread asleep in its wait.
    stops = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        server = TCPStoreServer(args.host, args.port)
    except (RendezvousError, ValueError) as exc:
        print(f"plait store: {exc}", file=sys.stderr, flush=True)
        return 1
    with server:
        if server.host in _ANY_HOST:  # not an address a rank can connect to
            use = f"tcp://<this host's address>:{server.port}"
            print(
                f"plait store: serving tcp://{server.address} on every interface; give the "
                f"ranks PLAIT_STORE={use}",
                flush=True,
            )
        else:
            print(f"plait store: serving tcp://{server.address} (PLAIT_STORE)", flush=True)
        signal.sigwait(stops)
    print("plait store: stopped", flush=True)
    return 0
