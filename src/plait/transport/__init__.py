"""Transports move bytes between ranks; they know nothing of collectives."""

from plait.transport.base import Handle, Transport

__all__ = ["Handle", "Transport"]
