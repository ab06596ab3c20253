"""The embedding engine: prompts in, one vector each out, over the pooling runner
(worker/pooling_runner.py) in the caller's process; no engine core, scheduler or KV cache pool.

`EmbeddingEngine` tokenizes and validates (vocabulary, max_model_len, truncate_prompt_tokens,
dimensions) and runs batches synchronously (`LLM.embed`). `EmbeddingBatcher` is the server's dynamic
batching over it: the prompts of requests that arrive within `wait_s` of the first one waiting
(or until max_num_batched_tokens of them wait) run as one call of the runner, on one worker thread
(the model's kernels release the GIL, so the event loop goes on serving)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.engine.input_processor import PromptType, check_token_ids, load_tokenizer
from tokenmill.outputs import EmbeddingOutput, EmbeddingRequestOutput
from tokenmill.worker.pooling_runner import PoolingRunner


class EmbeddingEngine:
    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False) -> None:
        if config.model.runner != "pooling":
            raise ValueError("this engine generates; embeddings need runner='pooling' (vLLM's name), e.g. "
                             "`tokenmill serve MODEL --runner pooling` or LLM(MODEL, runner='pooling')")
        self.config = config
        self.tokenizer: Any = None if skip_tokenizer_init else load_tokenizer(config.model.tokenizer)
        self.runner = PoolingRunner(config)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, skip_tokenizer_init: bool = False) -> EmbeddingEngine:
        return cls(args.create_engine_config(), skip_tokenizer_init)

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def num_batches(self) -> int:
        return self.runner.num_batches

    def tokenize(self, prompt: PromptType, truncate_prompt_tokens: int | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, checked. truncate_prompt_tokens k keeps its first k tokens (a text keeps
        its special tokens, as sentence-transformers truncates), -1 max_model_len of them; without it a
        prompt longer than max_model_len is an error."""
        limit = self._truncation(truncate_prompt_tokens)
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))  # type: ignore[assignment]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the input is empty")
            if self.tokenizer is None:
                raise ValueError("text inputs need a tokenizer; this engine was started without one")
            kw: dict[str, Any] = {"truncation": True, "max_length": limit} if limit is not None else {}
            ids = list(self.tokenizer(prompt, add_special_tokens=add_special_tokens, **kw)["input_ids"])
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)[:limit] if limit is not None else list(prompt)
        else:
            raise ValueError("an input must be a string or a list of token ids")
        if not ids:
            raise ValueError("the input is empty")
        check_token_ids(ids, self.config.model.arch.vocab_size, "the input")
        if len(ids) > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                             f"input has {len(ids)} tokens. Shorten it, or set truncate_prompt_tokens to cut it.")
        return ids

    def _truncation(self, k: int | None) -> int | None:
        if k is None:
            return None
        if k == -1:
            return self.max_model_len
        if not 1 <= k <= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or between 1 and max_model_len "
                             f"({self.max_model_len}), got {k}")
        return k

    def check_dimensions(self, dimensions: int | None) -> None:
        """`dimensions` only where the model was trained for truncated (Matryoshka) embeddings."""
        if dimensions is None:
            return
        arch = self.config.model.arch
        if arch.matryoshka_dimensions is None:
            raise ValueError(f"this model does not support matryoshka representation: its embeddings cannot be "
                             f"truncated, so dimensions cannot be set (it returns {arch.hidden_size})")
        if dimensions not in arch.matryoshka_dimensions:
            dims = arch.matryoshka_dimensions
            allowed = f"1..{arch.hidden_size}" if len(dims) == arch.hidden_size else ", ".join(map(str, dims))
            raise ValueError(f"dimensions {dimensions} is not one this model supports ({allowed})")

    def embed_ids(self, prompts: list[list[int]], dimensions: list[int | None] | None = None) -> list[torch.Tensor]:
        return self.runner.embed(prompts, dimensions)

    def embed(self, prompts: list[PromptType], truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        self.check_dimensions(dimensions)
        ids = [self.tokenize(p, truncate_prompt_tokens) for p in prompts]
        vectors = self.embed_ids(ids, [dimensions] * len(ids))
        return [EmbeddingRequestOutput(str(next(self._ids)), EmbeddingOutput(v.tolist()), p)
                for p, v in zip(ids, vectors, strict=True)]


@dataclass
class _Pending:
    token_ids: list[int]
    dimensions: int | None
    future: asyncio.Future[torch.Tensor] = field(repr=False)


class EmbeddingBatcher:
    """Dynamic batching for the server: see the module's docstring."""

    def __init__(self, engine: EmbeddingEngine, wait_s: float) -> None:
        if wait_s < 0:
            raise ValueError(f"the batching window must be >= 0 seconds, got {wait_s}")
        self.engine = engine
        self.wait_s = wait_s
        self.max_tokens = engine.config.scheduler.max_num_batched_tokens
        self._queue: list[_Pending] = []
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenmill-embed")
        self.num_groups = 0  # groups of requests handed to the runner together

    async def embed(self, prompts: list[list[int]], dimensions: int | None = None) -> list[torch.Tensor]:
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._arrived = asyncio.Event()
            self._task = loop.create_task(self._loop())
        items = [_Pending(p, dimensions, loop.create_future()) for p in prompts]
        self._queue.extend(items)
        assert self._arrived is not None
        self._arrived.set()
        return list(await asyncio.gather(*(i.future for i in items)))

    async def _loop(self) -> None:
        assert self._arrived is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            deadline = loop.time() + self.wait_s
            while loop.time() < deadline and sum(len(i.token_ids) for i in self._queue) < self.max_tokens:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
                except TimeoutError:
                    break
            group, self._queue = self._queue, []
            self._arrived.clear()
            group = [i for i in group if not i.future.done()]  # a request that was cancelled meanwhile
            if not group:
                continue
            self.num_groups += 1
            try:
                vectors = await loop.run_in_executor(
                    self._pool, self.engine.embed_ids, [i.token_ids for i in group], [i.dimensions for i in group])
            except Exception as e:  # a failed batch fails its requests; the batcher goes on
                for i in group:
                    if not i.future.done():
                        i.future.set_exception(e)
                continue
            for i, v in zip(group, vectors, strict=True):
                if not i.future.done():
                    i.future.set_result(v)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
