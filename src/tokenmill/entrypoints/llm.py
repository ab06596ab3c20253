"""The offline API, shaped like vLLM's: `LLM(model=PATH).generate(prompts, params)`, and for an
embedding model (runner 'pooling', the default for encoder checkpoints) `LLM(model=PATH).embed(prompts)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.config import EngineArgs
from tokenmill.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from tokenmill.engine.input_processor import PromptType
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.pooling_engine import EmbeddingEngine
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str, skip_tokenizer_init: bool = False, **engine_args: Any) -> None:
        unknown = set(engine_args) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        config = EngineArgs(model=model, **engine_args).create_engine_config()
        if config.parallel.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs under `tokenmill serve --data-parallel-size N` (a process "
                             "per replica); the offline LLM runs one replica: use data_parallel_size 1")
        pooling = config.model.runner == "pooling"
        self.embedding_engine = EmbeddingEngine(config, skip_tokenizer_init) if pooling else None
        self._engine = None if pooling else LLMEngine(config, skip_tokenizer_init)

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise ValueError("this LLM runs an embedding model (runner 'pooling'): use embed(); generating needs "
                             "a decoder with runner='generate'")
        return self._engine

    def shutdown(self) -> None:
        """Stop the engine's worker thread or processes (a tensor-parallel engine's ranks); the object
        generates no more after it."""
        if self._engine is not None:
            self._engine.core.shutdown()

    def get_tokenizer(self) -> Any:
        if self.embedding_engine is not None:
            return self.embedding_engine.tokenizer
        return self.engine.get_tokenizer()

    def embed(self, prompts: PromptType | Sequence[PromptType], truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, a list of token ids or a {"prompt_token_ids": ...} dict),
        in their order; see engine/pooling_engine.py for truncate_prompt_tokens and dimensions."""
        if self.embedding_engine is None:
            raise ValueError("embed() needs an embedding model: LLM(MODEL, runner='pooling') (vLLM's name), with "
                             "--pooler-config's pooling for a decoder")
        return self.embedding_engine.embed(self._as_list(prompts), truncate_prompt_tokens, dimensions)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = self._as_list(prompts)
        params = self._params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priority values for {len(prompt_list)} prompts")
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params, strict=False)):
                p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(self.engine.add_request(None, prompt, p, priority[i] if priority else 0))
        except ValueError as e:
            self.engine.abort_request(ids)
            raise ValueError(f"prompt {len(ids)}: {e}") from None
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Per prompt, the beam_width best sequences, best first (engine/beam_search.py: transformers'
        rules; the beams share their prefix's full KV blocks through the prefix cache)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params must be a BeamSearchParams")
        return beam_search(self.engine, self._as_list(prompts), params)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conv in convs:
            try:
                ids = tok.apply_chat_template(conv, chat_template=chat_template, tokenize=True,
                                              add_generation_prompt=add_generation_prompt, return_dict=False)
            except Exception as e:  # jinja and transformers raise various types
                raise ValueError(f"cannot apply the chat template: {e}") from None
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in ids]

    @staticmethod
    def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [[int(t) for t in prompts]]
        return list(prompts)  # type: ignore[arg-type]

    @staticmethod
    def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be a SamplingParams or a list of them")
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return list(params)
