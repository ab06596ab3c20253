"""LLM.beam_search against transformers' beam search (float32, early_stopping=False) on every golden
fixture model, and the beams' sharing of KV blocks copy-on-write."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil

import pytest

from tests.conftest import random_prompts
from tests.engine.test_containment import Faulty
from tests.fixtures import MODEL_SPECS, hf_beam_search
from tokenmill import LLM, BeamSearchOutput, BeamSearchParams
from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.beam_search import beam_search, beam_search_async

PROMPTS = random_prompts(4, 3, 40, seed=5)
MAX_TOKENS = 10
CASES = [(width, penalty) for width in (2, 4) for penalty in (1.0, 0.5)]


def with_eos(model_dir: str, out_dir: str, eos: int) -> str:
    """A copy of the checkpoint whose EOS id is `eos` (the tokenizer's EOS stays one too)."""
    shutil.copytree(model_dir, out_dir)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(out_dir, name)
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = eos
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f)
    return out_dir


def frequent_token(model_dir: str) -> int:
    """The token transformers' beams emit most often on PROMPTS: as EOS, it ends some of them."""
    counts: collections.Counter[int] = collections.Counter()
    for prompt in PROMPTS:
        for tokens, _ in hf_beam_search(model_dir, prompt, 4, MAX_TOKENS, 1.0, None):
            counts.update(tokens)
    return counts.most_common(1)[0][0]


def check_against_hf(llm: LLM, model_dir: str, eos: list[int] | None) -> list[str]:
    """Every case, all prompts in one beam_search call; returns the finish reasons seen."""
    reasons = []
    for width, penalty in CASES:
        params = BeamSearchParams(width, MAX_TOKENS, ignore_eos=eos is None, length_penalty=penalty)
        outs = llm.beam_search(PROMPTS, params)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            ref = hf_beam_search(model_dir, prompt, width, MAX_TOKENS, penalty, eos)
            got = out.sequences
            case = f"width {width}, length_penalty {penalty}, prompt {prompt}"
            assert [s.output_token_ids for s in got] == [tokens for tokens, _ in ref], case
            assert [s.score for s in got] == pytest.approx([score for _, score in ref], rel=1e-4, abs=1e-5), case
            assert all(s.tokens[:len(prompt)] == prompt for s in got)
            reasons += [s.finish_reason or "" for s in got]
    return reasons


@pytest.mark.parametrize("name", list(MODEL_SPECS))
def test_matches_transformers_without_eos(model_dirs: dict[str, str], name: str) -> None:
    llm = LLM(model_dirs[name], dtype="float32", kv_cache_memory="8MiB")
    assert set(check_against_hf(llm, model_dirs[name], None)) == {"length"}


@pytest.mark.parametrize("name", list(MODEL_SPECS))
def test_matches_transformers_with_eos(model_dirs: dict[str, str], tmp_path: str, name: str) -> None:
    model_dir = with_eos(model_dirs[name], os.path.join(tmp_path, name), frequent_token(model_dirs[name]))
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB")
    eos = list(llm.engine.input_processor.eos_token_ids)
    assert len(eos) == 2  # the tokenizer's and the config's: transformers then keeps 3 * width candidates
    reasons = check_against_hf(llm, model_dir, eos)
    assert "stop" in reasons  # some hypotheses did end in EOS


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_beams_share_blocks_copy_on_write(llama_dir: str, prefix_caching: bool) -> None:
    """A W=4 search over a prompt whose last block is partial: every step computes one token per beam
    (nothing of the prompt or of the beams' tokens is recomputed), the partial blocks are copied when
    a beam writes into a shared one, the peak of blocks in use is no more than recomputing through
    the prefix cache needs (and under half of it with the prefix cache off), the sequences are the
    same, and every block is back in the pool."""
    block_size, width, max_tokens = 8, 4, 8
    prompt = random_prompts(1, 61, 61, seed=3)[0]
    params = BeamSearchParams(width, max_tokens, ignore_eos=True)
    figures = {}
    results = {}
    for share in (True, False):
        llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", block_size=block_size,
                  enable_prefix_caching=prefix_caching)
        engine = llm.engine
        out = beam_search(engine, [prompt], params, share_kv=share)[0]
        stats = engine.core.scheduler.stats()
        figures[share] = (stats.num_scheduled_tokens, stats.peak_used_blocks, stats.num_blocks_copied)
        results[share] = [(s.tokens, s.score) for s in out.sequences]
        kv = engine.core.scheduler.kv
        assert kv.num_free_blocks == engine.core.num_blocks  # nothing leaked, nothing kept
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks) and not kv.req_blocks and not engine.core.scheduler.held
        assert not engine.has_unfinished_requests()
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]]
    assert [x for _, x in results[True]] == pytest.approx([x for _, x in results[False]], rel=1e-4)
    tokens, peak, copies = figures[True]
    assert tokens == len(prompt) + (max_tokens - 1) * width
    assert copies >= width - 1  # the prompt's partial block, shared by the first step's W children
    old_tokens, old_peak, old_copies = figures[False]
    # recomputing: each step's partial last block at least (the whole context without the prefix cache)
    assert old_copies == 0 and old_tokens - len(prompt) > 3 * (tokens - len(prompt))
    assert peak <= old_peak if prefix_caching else 2 * peak <= old_peak


def test_output_shape(llama_dir: str) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB")
    tok = llm.get_tokenizer()
    out = llm.beam_search("def main():", BeamSearchParams(3, 5, ignore_eos=True))
    assert len(out) == 1 and len(out[0].sequences) == 3
    seqs = out[0].sequences
    assert [s.score for s in seqs] == sorted((s.score for s in seqs), reverse=True)
    for s in seqs:
        assert s.text == tok.decode(s.tokens)
        assert s.tokens[:s.num_prompt_tokens] == tok("def main():")["input_ids"]
        assert len(s.logprobs) == 5 and s.finish_reason == "length"
        chosen = [pos[t].logprob for pos, t in zip(s.logprobs, s.output_token_ids, strict=True)]
        assert s.cum_logprob == pytest.approx(sum(chosen)) and s.score == pytest.approx(s.cum_logprob / 5)
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search("x", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocabulary"):
        llm.beam_search("x", BeamSearchParams(300, 2))


def test_async_driver_matches(llama_dir: str) -> None:
    """beam_search_async, the server's way (AsyncLLM, its core in its own process), gives LLM.beam_search's
    sequences, and leaves no request behind."""
    params = BeamSearchParams(3, 6, ignore_eos=True, length_penalty=0.5)
    prompt = PROMPTS[1]
    expected = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB").beam_search([prompt], params)[0]

    async def main() -> tuple[BeamSearchOutput, int]:
        engine = await AsyncLLM.from_engine_args(EngineArgs(llama_dir, dtype="float32", kv_cache_memory="8MiB"))
        try:
            out = await beam_search_async(engine, {"prompt_token_ids": prompt}, params)
            return out, engine.num_unfinished_requests
        finally:
            await engine.shutdown()

    got, unfinished = asyncio.run(main())
    assert [s.tokens for s in got.sequences] == [s.tokens for s in expected.sequences]
    assert [s.score for s in got.sequences] == pytest.approx([s.score for s in expected.sequences])
    assert [s.text for s in got.sequences] == [s.text for s in expected.sequences]
    assert unfinished == 0


def test_a_failed_step_ends_the_search_and_leaves_nothing_behind(llama_dir: str) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", async_scheduling=False)
    params = BeamSearchParams(2, 6, ignore_eos=True)
    expected = llm.beam_search(PROMPTS[:2], params)
    runner = llm.engine.core.executor.runner
    model = runner.model
    runner.model = Faulty(model, fail_calls={3})
    runner.fused_decode = None
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.beam_search(PROMPTS[:2], params)
    kv = llm.engine.core.scheduler.kv
    assert not llm.engine.has_unfinished_requests() and kv.num_free_blocks == llm.engine.core.num_blocks
    runner.model = model
    assert [[s.tokens for s in o.sequences] for o in llm.beam_search(PROMPTS[:2], params)] == \
        [[s.tokens for s in o.sequences] for o in expected]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_shared_blocks_of_a_quantized_cache(llama_dir: str, kv_cache_dtype: str) -> None:
    """With an int8 / fp8 KV cache the copied blocks carry their scales: sharing gives the sequences that
    recomputing every beam's context with the same cache gives."""
    prompt = random_prompts(1, 29, 29, seed=8)[0]  # 29 tokens: a partial last block (32 a block on a CPU)
    params = BeamSearchParams(4, 12, ignore_eos=True)
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", kv_cache_dtype=kv_cache_dtype,
              enable_prefix_caching=False)
    shared = beam_search(llm.engine, [prompt], params)[0]
    assert llm.engine.core.scheduler.stats().num_blocks_copied > 0
    recomputed = beam_search(llm.engine, [prompt], params, share_kv=False)[0]
    assert [s.tokens for s in shared.sequences] == [s.tokens for s in recomputed.sequences]
    assert llm.engine.core.scheduler.kv.num_free_blocks == llm.engine.core.num_blocks
