"""What the API process and the engine core process say to each other: the message kinds,
their typed msgspec payloads (besides core.messages' EngineCoreRequest and EngineCoreOutputs),
and the one encoder and decoders both sides use.

A message is two ZMQ frames, `[kind, msgpack payload]`. Both processes import this module;
the core's side is core_proc, the API process's side core_client.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest

# message kinds, API process -> core
ADD, ABORT, UTILITY, SHUTDOWN = b"A", b"X", b"U", b"S"
# core -> API process
OUTPUTS, UTILITY_RESULT, READY, FAILED = b"O", b"R", b"Y", b"F"

# the EngineCore methods a UTILITY message may call (no arguments)
UTILITY_METHODS = ("reset_prefix_cache", "prepare_structured_output")


class AbortRequests(msgspec.Struct, array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class CoreReady(msgspec.Struct, array_like=True):
    pid: int
    num_blocks: int
    load_seconds: float


class CoreFailed(msgspec.Struct, array_like=True):
    message: str


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served."""


encode = msgspec.msgpack.Encoder().encode
# ADD carries each request undecoded: the core decodes them one by one (decode_request), so that a
# request it cannot decode fails alone, by its id, instead of the whole message
_DECODERS: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    ADD: msgspec.msgpack.Decoder(list[msgspec.Raw]), ABORT: msgspec.msgpack.Decoder(AbortRequests),
    UTILITY: msgspec.msgpack.Decoder(UtilityCall), OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
    UTILITY_RESULT: msgspec.msgpack.Decoder(UtilityResult), READY: msgspec.msgpack.Decoder(CoreReady),
    FAILED: msgspec.msgpack.Decoder(CoreFailed),
}


_REQUEST = msgspec.msgpack.Decoder(EngineCoreRequest)
_FIELDS = msgspec.msgpack.Decoder(list[Any])


def decode_request(raw: msgspec.Raw) -> EngineCoreRequest:
    """One request of an ADD message (ValueError where it does not decode or validate)."""
    try:
        return _REQUEST.decode(raw)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise ValueError(f"the request could not be decoded: {e}") from None


def request_id_of(raw: msgspec.Raw) -> str | None:
    """The id of an encoded request (its first field), where it has one."""
    try:
        fields = _FIELDS.decode(raw)
    except msgspec.DecodeError:
        return None
    return fields[0] if fields and isinstance(fields[0], str) else None


def decode(frames: list[bytes]) -> tuple[bytes, Any]:
    """(kind, payload); the payload is None for a kind that carries none (SHUTDOWN)."""
    kind = bytes(frames[0])
    return kind, (_DECODERS[kind].decode(frames[1]) if kind in _DECODERS else None)
