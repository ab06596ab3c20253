"""tokenmill's default connector: ZMQ over TCP, msgspec/msgpack framing.

A producer binds a ROUTER socket on kv_ip:kv_port; a consumer keeps one DEALER socket per producer address
it pulls from. A message is `[msgpack(struct)]`, a block `[msgpack(KVBlock), bytes]` (the KV bytes are not
copied into msgpack). Sends never block (no high-water mark); a send to a consumer that is gone fails at
once (ROUTER_MANDATORY) and stops that transfer. The consumer's waits are bounded by its transfer timeout
(core/kv_transfer.py), so a producer that dies is noticed without ZMQ telling.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

from tokenmill.core.kv_transfer import Incoming, KVBlock, KVMessage, Outgoing
from tokenmill.kv_transfer.base import KVConnector
from tokenmill.kv_transfer_config import KVTransferConfig

logger = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode
_decoder: msgspec.msgpack.Decoder[KVMessage] = msgspec.msgpack.Decoder(KVMessage)


class ZMQConnector(KVConnector):
    def __init__(self, config: KVTransferConfig) -> None:
        self.ctx = zmq.Context()
        self.server: zmq.Socket[bytes] | None = None
        self.peers: dict[tuple[str, int], zmq.Socket[bytes]] = {}
        self.poller = zmq.Poller()
        if config.is_producer:
            server = self.ctx.socket(zmq.ROUTER)
            server.setsockopt(zmq.ROUTER_MANDATORY, 1)
            server.setsockopt(zmq.SNDHWM, 0)
            server.setsockopt(zmq.RCVHWM, 0)
            server.setsockopt(zmq.LINGER, 0)
            try:
                server.bind(f"tcp://{config.kv_ip}:{config.kv_port}")
            except zmq.ZMQError as e:
                server.close(0)
                self.ctx.term()
                raise ValueError(f"kv_transfer_config: cannot listen on {config.kv_ip}:{config.kv_port} "
                                 f"({e.strerror}); choose another kv_port or kv_ip") from None
            self.server = server
            self.poller.register(server, zmq.POLLIN)

    def _peer(self, host: str, port: int) -> zmq.Socket[bytes]:
        sock = self.peers.get((host, port))
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(f"tcp://{host}:{port}")
            except zmq.ZMQError:
                sock.close(0)
                raise
            self.peers[(host, port)] = sock
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def receive(self) -> list[Incoming]:
        out: list[Incoming] = []
        if self.server is not None:
            out += self._drain(self.server, routed=True)
        for sock in list(self.peers.values()):
            out += self._drain(sock, routed=False)
        return out

    @staticmethod
    def _drain(sock: zmq.Socket[bytes], routed: bool) -> list[Incoming]:
        out: list[Incoming] = []
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            peer = frames.pop(0) if routed else b""
            if not frames:
                continue
            try:
                message = _decoder.decode(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("dropped a KV transfer message that does not decode: %s", e)
                continue
            payload = frames[1] if len(frames) > 1 and isinstance(message, KVBlock) else b""
            out.append(Incoming(message, peer, payload))

    def send(self, messages: list[Outgoing]) -> list[str]:
        unreachable: list[str] = []
        for m in messages:
            frames: list[Any] = [_encode(m.message)]
            if isinstance(m.message, KVBlock):
                frames.append(m.payload)
            try:
                if m.peer:
                    if self.server is None:
                        continue
                    self.server.send_multipart([m.peer, *frames], zmq.NOBLOCK, copy=False)
                else:
                    self._peer(m.host, m.port).send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:  # EHOSTUNREACH: the consumer is gone
                logger.warning("KV transfer %s: cannot reach its peer (%s)", m.message.transfer_id, e.strerror)
                unreachable.append(m.message.transfer_id)
        return unreachable

    def wait(self, timeout_s: float) -> None:
        self.poller.poll(max(0, int(timeout_s * 1000)))

    def pollables(self) -> list[Any]:
        # the producer's socket (a consumer waiting on its pulls waits in `wait`, inside the engine's step)
        return [self.server] if self.server is not None else []

    def close(self) -> None:
        for sock in [self.server, *self.peers.values()]:
            if sock is not None:
                sock.close(0)
        self.peers.clear()
        self.server = None
        self.ctx.term()
