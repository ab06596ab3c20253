"""`POST /v1/embeddings` in OpenAI's shape (vLLM's extras: truncate_prompt_tokens, add_special_tokens),
over the embedding engine's dynamic batcher (engine/pooling_engine.py), and the request and response
schemas. `input` is a string, a list of strings, a list of token ids or a list of token-id lists;
`encoding_format` float or base64 (little-endian float32, as the openai SDK decodes it)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, ClassVar, Literal

import torch
from pydantic import BaseModel, Field

from tokenmill.engine.pooling_engine import EmbeddingBatcher, EmbeddingEngine
from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.request_types import INTEGRAL, NonEmptyStr, OpenAIRequest, TokenId
from tokenmill.sampling_params import INT64_MAX

EmbeddingInput = (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
                  | Annotated[list[TokenId], Field(min_length=1)]
                  | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])


class EmbeddingRequest(OpenAIRequest):
    checks_unicode: ClassVar[bool] = True
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT64_MAX), INTEGRAL] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX), INTEGRAL] | None = None
    add_special_tokens: bool = True

    def inputs(self) -> list[str] | list[list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]
        return value  # type: ignore[return-value]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_vector(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()
    values: list[float] = vector.tolist()
    return values


class OpenAIServingEmbedding:
    def __init__(self, engine: EmbeddingEngine, batcher: EmbeddingBatcher, model_name: str,
                 model_aliases: frozenset[str], max_inputs: int) -> None:
        self.engine = engine
        self.batcher = batcher
        self.model_name = model_name
        self.model_aliases = model_aliases
        self.max_inputs = max_inputs

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.model_aliases:
            raise APIError("model_not_found", f"The model `{name}` does not exist.", "model")

    def token_ids(self, req: EmbeddingRequest) -> list[list[int]]:
        inputs = req.inputs()
        if len(inputs) > self.max_inputs:
            raise bad_request(f"input holds {len(inputs)} inputs; this server takes at most {self.max_inputs} a "
                              "request (--max-prompts-per-request)", "input", "too_many_sequences")
        try:
            self.engine.check_dimensions(req.dimensions)
        except ValueError as e:
            raise bad_request(str(e), "dimensions") from None
        out = []
        for prompt in inputs:
            try:
                out.append(self.engine.tokenize(prompt, req.truncate_prompt_tokens, req.add_special_tokens))
            except ValueError as e:
                code = "context_length_exceeded" if "maximum context length" in str(e) else "invalid_value"
                param = "truncate_prompt_tokens" if "truncate_prompt_tokens must" in str(e) else "input"
                raise bad_request(str(e), param, code) from None
        return out

    async def create(self, req: EmbeddingRequest) -> EmbeddingResponse:
        self.check_model(req.model)
        ids = self.token_ids(req)
        vectors = await self.batcher.embed(ids, req.dimensions)
        tokens = sum(len(p) for p in ids)
        data = [EmbeddingData(embedding=encode_vector(v, req.encoding_format), index=i)
                for i, v in enumerate(vectors)]
        return EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", model=self.model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
