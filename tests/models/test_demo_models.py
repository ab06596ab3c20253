"""The shipped demo models (models/tokenmill-demo, models/tokenmill-draft) load and generate offline.

The checkpoints are made by tools/train_demo_models.py; these tests only read them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MODELS = [REPO / "models" / "tokenmill-demo", REPO / "models" / "tokenmill-draft"]
IDS = [p.name for p in MODELS]
PROMPTS = [
    "KING.\nWhat news from France, my lord?\n\nMESSENGER.\n",
    "O, what a noble mind is here",
    "<|user|>\nGood morrow, sir.<|end|>\n<|assistant|>\n",
]
MAX_TOKENS = 8


def _load(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return tok, model.eval()


def _hf_greedy(tok, model, prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:  # type: ignore[no-untyped-def]
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("path", MODELS, ids=IDS)
def test_checkpoint_files_and_config(path: Path) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    ):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["max_position_embeddings"] >= 1024
    assert config["eos_token_id"] == 0
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 0
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("path", MODELS, ids=IDS)
def test_transformers_loads_and_generates(path: Path) -> None:
    tok, model = _load(path)
    assert tok.eos_token == "<|end|>" and tok.eos_token_id == model.config.eos_token_id
    assert tok.bos_token is None
    messages = [{"role": "system", "content": "A scene from Hamlet."}, {"role": "user", "content": "Who's there?"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|system|>\nA scene from Hamlet.<|end|>\n<|user|>\nWho's there?<|end|>\n<|assistant|>\n"
    assert tok.convert_ids_to_tokens(tok(rendered).input_ids[:2]) == ["<|system|>", "Ċ"]
    for prompt in (PROMPTS[0], rendered):
        new = _hf_greedy(tok, model, prompt)
        assert new and tok.decode(new, skip_special_tokens=True).strip()


@pytest.mark.parametrize("path", MODELS, ids=IDS)
def test_card_reports_held_out_perplexity(path: Path) -> None:
    """Each card's table: the target clearly beats the draft, both far better than uniform."""
    card = (path / "README.md").read_text()
    ppl = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^\| tokenmill-(demo|draft) \((?:target|draft)\) \| ([0-9.]+) \|$", card, re.M)
    }
    assert ppl["demo"] < 0.95 * ppl["draft"] < 0.95 * 8192 / 20


@pytest.mark.parametrize("path", MODELS, ids=IDS)
def test_tokenmill_greedy_matches_transformers(path: Path) -> None:

    from tokenmill import LLM, SamplingParams

    tok, model = _load(path)
    expected = [_hf_greedy(tok, model, p) for p in PROMPTS]
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
