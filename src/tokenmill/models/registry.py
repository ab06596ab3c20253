"""Model architectures by `config.architectures[0]`, imported lazily."""

from __future__ import annotations

import importlib

from tokenmill.models.arch import SUPPORTED_ARCHITECTURES

_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
}
assert set(_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type:
    if architecture not in _REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(_REGISTRY))}")
    module, cls = _REGISTRY[architecture].split(":")
    model_cls: type = getattr(importlib.import_module(module), cls)
    return model_cls
