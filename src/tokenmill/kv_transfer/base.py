"""The connector interface: how the engine core's KV transfer messages (core/kv_transfer.py) reach other
instances. A connector only moves messages; what to send and what a message means is the scheduler's."""

from __future__ import annotations

import abc
from typing import Any

from tokenmill.core.kv_transfer import Incoming, Outgoing


class KVConnector(abc.ABC):
    @abc.abstractmethod
    def receive(self) -> list[Incoming]:
        """Every message that has arrived, without waiting."""

    @abc.abstractmethod
    def send(self, messages: list[Outgoing]) -> list[str]:
        """Send, without waiting; returns the transfer ids of messages whose peer cannot be reached (their
        transfers stop)."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until a message may have arrived or timeout_s passed."""

    def pollables(self) -> list[Any]:
        """Sockets the engine core's loop may poll to wake when a message comes (zmq sockets)."""
        return []

    @abc.abstractmethod
    def close(self) -> None: ...
