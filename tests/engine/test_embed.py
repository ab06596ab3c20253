"""Embeddings from a decoder (last-token and mean pooling over its final hidden states, against
transformers), the runner choice (--runner / --task / --pooler-config as vLLM names them), Matryoshka
`dimensions`, and the server's dynamic batching: concurrent requests run as fewer batches, with the
results they get alone."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import random_prompts
from tokenmill.config import EngineArgs
from tokenmill.engine.pooling_engine import EmbeddingBatcher, EmbeddingEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.pooling import parse_pooler_config


def hf_hidden(model_dir: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden: torch.Tensor = model(torch.tensor([prompt])).last_hidden_state[0]
    return hidden


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_decoder_pooling_equals_transformers(llama_dir: str, pooling: str) -> None:
    prompts = random_prompts(5, 1, 70, seed=5)
    llm = LLM(llama_dir, runner="pooling", dtype="float32", attention_backend="sdpa",
              pooler_config=json.dumps({"pooling_type": pooling}), max_num_batched_tokens=100, block_size=16)
    got = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts])])
    hidden = [hf_hidden(llama_dir, p) for p in prompts]
    want = F.normalize(torch.stack([h[-1] if pooling == "LAST" else h.mean(0) for h in hidden]), dim=-1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert llm.embedding_engine is not None and llm.embedding_engine.num_batches > 1


def test_runner_flags(llama_dir: str, bert_dir: str) -> None:
    assert EngineArgs(llama_dir).create_engine_config().model.runner == "generate"
    assert EngineArgs(bert_dir).create_engine_config().model.runner == "pooling"
    cfg = EngineArgs(llama_dir, task="embed").create_engine_config().model
    assert (cfg.runner, cfg.pooler and cfg.pooler.pooling_type) == ("pooling", "LAST")  # vLLM's decoder default
    with pytest.raises(ValueError, match="no language-model head"):
        EngineArgs(bert_dir, runner="generate").create_engine_config()
    with pytest.raises(ValueError, match="pooling runner only"):
        EngineArgs(llama_dir, pooler_config='{"pooling_type": "MEAN"}').create_engine_config()
    with pytest.raises(ValueError, match="runner must be"):
        EngineArgs(llama_dir, runner="embed").create_engine_config()
    for bad, match in (('{"pooling_type": "MAX"}', "MAX"), ("{", "not valid JSON"), ('{"softmax": true}', "softmax")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(llama_dir, runner="pooling", pooler_config=bad).create_engine_config()
    assert parse_pooler_config('{"pooling_type": "mean", "normalize": false}') == {"pooling_type": "MEAN",
                                                                                   "normalize": False}


def test_generate_and_embed_refuse_the_other_kind(llama_dir: str, bert_dir: str) -> None:
    with pytest.raises(ValueError, match="use embed"):
        LLM(bert_dir).generate(["hello"])
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(llama_dir, dtype="float32", max_model_len=128, num_kv_blocks=8).embed(["hello"])


def test_matryoshka_dimensions(tmp_path: Any, bert_dir: str) -> None:
    model_dir = str(tmp_path / "matryoshka")
    shutil.copytree(bert_dir, model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({**cfg, "matryoshka_dimensions": [16, 32, 64]}, f)
    llm = LLM(model_dir)
    full = torch.tensor(llm.embed([[5, 6, 7, 8]])[0].outputs.embedding)
    short = torch.tensor(llm.embed([[5, 6, 7, 8]], dimensions=16)[0].outputs.embedding)
    assert short.shape == (16,) and abs(float(short.norm()) - 1) < 1e-5
    # the unnormalised vector's first 16 entries, renormalised
    torch.testing.assert_close(short, F.normalize(full[:16], dim=0), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="16, 32, 64"):
        llm.embed([[5, 6]], dimensions=20)


def test_bad_inputs(bert_dir: str) -> None:
    llm = LLM(bert_dir)
    for prompts, match in (([""], "empty"), ([[]], "empty"), ([[600]], "out of vocabulary"),
                           ([[1] * 97], "maximum context length is 96"), ([3.5], "string or a list")):
        with pytest.raises(ValueError, match=match):
            llm.embed(prompts)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed(["a b"], truncate_prompt_tokens=0)
    assert len(llm.embed([[1] * 97], truncate_prompt_tokens=-1)[0].prompt_token_ids) == 96


def test_concurrent_requests_are_batched_with_the_results_they_get_alone(bert_dir: str) -> None:
    engine = EmbeddingEngine(EngineArgs(bert_dir).create_engine_config())
    prompts = random_prompts(12, 3, 60, seed=9)
    alone = [engine.embed_ids([p])[0] for p in prompts]
    before = engine.num_batches

    async def run() -> tuple[list[torch.Tensor], int]:
        batcher = EmbeddingBatcher(engine, wait_s=0.05)
        # twelve requests, sent one after another without waiting (as concurrent clients do)
        results = await asyncio.gather(*(batcher.embed([p]) for p in prompts))
        await batcher.shutdown()
        return [r[0] for r in results], batcher.num_groups

    together, groups = asyncio.run(run())
    assert groups < len(prompts) and engine.num_batches - before < len(prompts)
    torch.testing.assert_close(torch.stack(together), torch.stack(alone), atol=1e-5, rtol=1e-4)
