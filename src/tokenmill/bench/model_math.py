"""The benches' name for `tokenmill.model_math` (bytes and FLOPs of a checkpoint), which moved below
the engine so that the serving metrics can count a step's work with the same arithmetic."""

from __future__ import annotations

from tokenmill.model_math import (
    INT4_GROUP,
    QUANTIZED_FORMATS,
    DecodeFloor,
    ModelCost,
    decode_floor,
    decode_positions,
    dtype_bytes,
    kv_capacity,
    max_requests,
)

__all__ = ["INT4_GROUP", "QUANTIZED_FORMATS", "DecodeFloor", "ModelCost", "decode_floor", "decode_positions",
           "dtype_bytes", "kv_capacity", "max_requests"]
