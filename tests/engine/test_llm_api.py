"""The offline API as a vLLM user would drive it, and `tokenmill generate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import random_prompts
from tokenmill import LLM, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    return LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB")


def test_prompt_forms_agree(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    text = "def main():\n    return"
    ids = tok(text)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": text}], params, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)
    assert outs[0].outputs[0].finish_reason == "length"


def test_outputs_in_input_order_with_timing(llm: LLM) -> None:
    prompts = [[10 + i] * (3 + 7 * i) for i in range(6)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True)
                                  for i in range(6)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [2 + i for i in range(6)]
    for o in outs:
        m = o.metrics
        assert m is not None and m.first_scheduled_time is not None
        assert m.first_token_time is not None and m.finished_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_queued_request_metrics_and_cached_tokens(llama_dir: str) -> None:
    # one sequence at a time: b waits in the queue for a, then finds a's prompt in the prefix cache
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=1, block_size=16)
    a = random_prompts(1, 80, 80, seed=41)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out_a, out_b = llm.generate([a, a + [7]], params, use_tqdm=False)
    assert_queued_after(out_a, out_b)
    assert llm.engine.core.scheduler.kv.num_free_blocks == llm.engine.core.num_blocks


def assert_queued_after(out_a: RequestOutput, out_b: RequestOutput) -> None:
    """b (a's 80-token prompt plus one token) ran after a, with a's prompt blocks cached."""
    ma, mb = out_a.metrics, out_b.metrics
    assert ma is not None and mb is not None
    for m in (ma, mb):
        assert m.first_scheduled_time is not None and m.first_token_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert ma.first_scheduled_time is not None and mb.first_scheduled_time is not None
    assert mb.first_scheduled_time > ma.first_scheduled_time
    assert out_a.num_cached_tokens == 0
    assert 0 < out_b.num_cached_tokens <= 80 and out_b.num_cached_tokens % 16 == 0


def test_n_samples_and_seed(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    a = llm.generate(["import os"], params, use_tqdm=False)[0]
    b = llm.generate(["import os"], params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # children draw different seeds


def test_chat_uses_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("assistant:")
    assert out.prompt_token_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert len(out.outputs[0].token_ids) == 5


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    # ban everything but EOS (id 0) so the first sampled token is EOS
    bias = {i: -100.0 for i in range(1, 512)}
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=5, logit_bias=bias), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [0] and out.outputs[0].finish_reason == "stop"
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=5, logit_bias=bias, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [0] * 5 and out.outputs[0].finish_reason == "length"


def test_progress_bar(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_cli_generate(llama_dir: str) -> None:
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "generate", "--model", llama_dir, "--dtype",
           "float32", "--kv-cache-memory", "4MiB", "--max-tokens", "6", "import sys"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="4MiB")
    expected = llm.generate(["import sys"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert done.stdout == expected[0].outputs[0].text + "\n"


def test_plain_tokenizer_fast_path_matches_autotokenizer() -> None:
    """load_tokenizer skips AutoTokenizer for plain tokenizer.json checkpoints (start-up time);
    it must tokenize and render chat templates exactly as AutoTokenizer does."""
    from transformers import AutoTokenizer

    from tokenmill.engine.input_processor import load_tokenizer

    path = str(Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo")
    fast, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = "ROMEO.\nBut soft, what light through yonder window breaks? Ça va — 東京 🌹"
    assert fast(text)["input_ids"] == auto(text)["input_ids"]
    messages = [{"role": "user", "content": "Good morrow."}]
    assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert fast.eos_token_id == auto.eos_token_id
