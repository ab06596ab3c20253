"""Prompts in, validated EngineCoreRequests out: tokenize, check length and vocabulary.

check_token_ids and resolve_max_tokens are the one vocabulary check and the one max_tokens rule;
the OpenAI server calls them too, for what it checks before a request reaches the engine."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.core.messages import EngineCoreRequest, KVTransferParams
from tokenmill.engine import tokenizer_cache
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.grammar import check_structured_outputs

PromptType = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class KVSharing:
    """How a request shares KV blocks with others (beam search): `hold` keeps its blocks once it
    finishes, until it is aborted; `parent` names a kept request whose blocks it starts from; `transfer`
    is its part in disaggregated prefill/decode, with another instance (core/kv_transfer.py)."""

    hold: bool = False
    parent: str | None = None
    transfer: KVTransferParams | None = None


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


_PLAIN_FAST_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")


def check_token_ids(ids: Iterable[int], vocab_size: int, name: str) -> None:
    """Every id must index the vocabulary; the error names `name`, the field that holds them."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name} has token id {bad}, out of vocabulary (valid ids are 0..{vocab_size - 1})")


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, *, must_fit: bool = False,
                       name: str = "max_tokens") -> int:
    """The output-token limit of a prompt of prompt_len tokens: None is all the room max_model_len
    leaves. A limit past that room is an error when must_fit (the OpenAI server, as OpenAI's API does);
    otherwise generation stops at max_model_len ("length")."""
    if max_tokens is None:
        return max_model_len - prompt_len
    if max_tokens < 1:
        raise ValueError(f"{name} must be at least 1, got {max_tokens}")
    if must_fit and prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or completion.")
    return max_tokens


def load_tokenizer(path: str) -> Any:
    """transformers' tokenizer for the checkpoint. AutoTokenizer, whose imports cost seconds of
    start-up, runs only where neither shortcut applies: a plain tokenizer.json (no model-specific
    tokenizer class) loads as PreTrainedTokenizerFast, and a checkpoint whose class AutoTokenizer chose
    before loads that class (tokenizer_cache)."""
    try:
        if _tokenizer_class(path) in _PLAIN_FAST_CLASSES and os.path.isfile(os.path.join(path, "tokenizer.json")):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        cls = tokenizer_cache.cached_class(path)
        if cls is not None:
            try:
                return cls.from_pretrained(path, local_files_only=True)  # type: ignore[attr-defined]
            except Exception:  # transformers raises many types here; AutoTokenizer decides again
                pass
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from None
    tokenizer_cache.remember(path, tokenizer)
    return tokenizer


def _tokenizer_class(path: str) -> str | None:
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return cls if isinstance(cls, str) else None


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any | None, grammar_backend: str = "xgrammar") -> None:
        self.config = model_config
        self.tokenizer = tokenizer
        self.grammar_backend = grammar_backend  # the engine's (--structured-outputs-config), which checks constraints
        eos = set(model_config.arch.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> ProcessedPrompt:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return ProcessedPrompt(prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"]))
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"], add_special_tokens)
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine was started without one")
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
            return ProcessedPrompt(prompt, self._check_ids(ids))
        if isinstance(prompt, (list, tuple)):
            return ProcessedPrompt(None, self._check_ids(prompt))
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in ids):
            raise ValueError("prompt token ids must be a list of integers")
        if not ids:
            raise ValueError("the prompt is empty")
        check_token_ids(ids, self.config.arch.vocab_size, "the prompt")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.config.max_model_len} "
                "(prompt plus at least one output token must fit)"
            )
        return list(ids)

    def make_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                     priority: int = 0, arrival_time: float | None = None, priority_class: int = 0,
                     group: str = "", kv: KVSharing | None = None) -> EngineCoreRequest:
        vocab = self.config.arch.vocab_size
        check_token_ids(params.logit_bias, vocab, "logit_bias")  # the sampler indexes logits with these
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        check_token_ids([t for w in params.bad_words_token_ids for t in w], vocab, "bad_words_token_ids")
        check_token_ids(params.prediction_token_ids or [], vocab, "prediction_token_ids")
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs, self.grammar_backend)
        max_tokens = resolve_max_tokens(len(prompt.prompt_token_ids), params.max_tokens, self.config.max_model_len)
        if max_tokens != params.max_tokens:
            params = params.clone(max_tokens=max_tokens)
        return EngineCoreRequest(request_id, prompt.prompt_token_ids, params, self.eos_token_ids,
                                 arrival_time or time.time(), priority, priority_class, group,
                                 kv is not None and kv.hold, kv.parent if kv is not None else None,
                                 kv.transfer if kv is not None else None)
