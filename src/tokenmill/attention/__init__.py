"""Attention backends over the paged KV cache, chosen by name from a registry."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry itself imports no torch: config validation uses it
    from tokenmill.attention.backend import AttentionBackend

_REGISTRY: dict[str, str] = {
    "torch_ref": "tokenmill.attention.torch_ref:TorchRefBackend",
    "cpu": "tokenmill.attention.cpu:CpuBackend",
    "sdpa": "tokenmill.attention.cpu:SdpaBackend",
    "cuda": "tokenmill.attention.cpu:SdpaBackend",  # the batched SDPA path, on the GPU
    "triton": "tokenmill.attention.triton_backend:TritonBackend",  # paged Triton kernels (a GPU's default)
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"attention backend {name!r} unknown; choose from {available_backends()}")
    module, cls = _REGISTRY[name].split(":")
    backend: AttentionBackend = getattr(importlib.import_module(module), cls)()
    return backend
