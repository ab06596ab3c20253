"""tokenmill: an LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tokenmill.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "StructuredOutputsParams",
           "EmbeddingRequestOutput", "EmbeddingOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":  # imported lazily: it pulls in torch
        from tokenmill.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
