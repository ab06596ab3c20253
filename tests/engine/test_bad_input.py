"""Bad input gets a ValueError a user can act on, never a traceback from deep inside, and
leaves the engine serving: no request stuck, no KV block leaked."""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import random_prompts
from tests.fixtures import VOCAB
from tokenmill import LLM, SamplingParams
from tokenmill.engine.input_processor import check_token_ids, resolve_max_tokens

SUPPORTED = "BertModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


# ---- sampling params -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["eos"]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: "big"}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_edge_values_are_accepted() -> None:
    p = SamplingParams(n=2, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=1, min_tokens=1,
                       stop="x", stop_token_ids=[0], logprobs=0, prompt_logprobs=0, presence_penalty=-2,
                       frequency_penalty=2, logit_bias={"3": -100})
    assert p.stop == ["x"] and p.top_k == 0 and p.greedy and p.logit_bias == {3: -100.0}
    assert SamplingParams(max_tokens=None).max_tokens is None


# ---- requests --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(llama_dir: str) -> Iterator[LLM]:
    yield LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
GOOD = random_prompts(3, 5, 30, seed=31)


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(GOOD, GREEDY, use_tqdm=False)]


def assert_still_serving(llm: LLM, baseline: list[list[int]]) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    kv = engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks == engine.core.num_blocks
    outs = llm.generate(GOOD, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not engine.output_processor.parents and not engine.core.scheduler.requests


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", GREEDY, "empty"),
        ([], GREEDY, "empty"),
        ({"prompt_token_ids": []}, GREEDY, "empty"),
        ({"text": "hi"}, GREEDY, "prompt"),
        ([5] * 512, GREEDY, "max_model_len"),
        ("word " * 600, GREEDY, "max_model_len"),
        ([5, VOCAB], GREEDY, "out of vocabulary"),
        ([-1, 5], GREEDY, "out of vocabulary"),
        ([5, 1.5], GREEDY, "integers"),
        (5, GREEDY, "prompt"),
        ([5, 6], GREEDY.clone(logit_bias={VOCAB: 1.0}), "logit_bias"),
        ([5, 6], GREEDY.clone(stop_token_ids=[VOCAB + 3]), "stop_token_ids"),
        ([5, 6], GREEDY.clone(min_tokens=2, stop_token_ids=[VOCAB]), "stop_token_ids"),
    ],
    ids=["empty-str", "empty-ids", "empty-dict", "bad-dict", "too-long-ids", "too-long-text", "oov", "negative",
         "float-id", "int", "bias-oov", "stop-id-oov", "min-tokens-stop-id-oov"],
)
def test_rejected_request_leaves_the_engine_serving(llm: LLM, baseline: list[list[int]], prompt: Any,
                                                    params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD[0], prompt, GOOD[1]], params, use_tqdm=False)
    assert_still_serving(llm, baseline)


def test_error_names_the_bad_prompt(llm: LLM, baseline: list[list[int]]) -> None:
    with pytest.raises(ValueError, match=r"^prompt 2: .*out of vocabulary"):
        llm.generate([GOOD[0], GOOD[1], [VOCAB + 7]], GREEDY, use_tqdm=False)
    assert_still_serving(llm, baseline)


def test_longest_prompt_that_fits(llm: LLM, baseline: list[list[int]]) -> None:
    out = llm.generate([[5] * 511], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"  # max_model_len is 512
    assert_still_serving(llm, baseline)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda llm: llm.generate(GOOD, [GREEDY, GREEDY], use_tqdm=False), "sampling params"),
        (lambda llm: llm.generate(GOOD, GREEDY, use_tqdm=False, priority=[0]), "priority"),
        (lambda llm: llm.generate(GOOD, {"temperature": 0.0}, use_tqdm=False), "SamplingParams"),
        (lambda llm: llm.engine.add_request("x", GOOD[0], {"temperature": 0.0}), "SamplingParams"),
    ],
    ids=["params-count", "priority-count", "params-dict", "engine-params-dict"],
)
def test_bad_generate_arguments(llm: LLM, baseline: list[list[int]], call: Callable[[LLM], Any],
                                message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert_still_serving(llm, baseline)


def test_duplicate_request_id_is_rejected(llm: LLM, baseline: list[list[int]]) -> None:
    engine = llm.engine
    engine.add_request("dup", GOOD[0], GREEDY)
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", GOOD[1], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert_still_serving(llm, baseline)


def test_one_vocabulary_check_and_one_max_tokens_rule() -> None:
    check_token_ids([0, VOCAB - 1], VOCAB, "tokens")
    for ids in ([0, VOCAB], [-1]):
        with pytest.raises(ValueError, match=rf"^tokens has token id {ids[-1]}, out of vocabulary .*0\.\.{VOCAB - 1}"):
            check_token_ids(ids, VOCAB, "tokens")
    assert resolve_max_tokens(10, None, 512) == 502
    assert resolve_max_tokens(10, 600, 512) == 600  # offline: generation stops at max_model_len
    assert resolve_max_tokens(10, 502, 512, must_fit=True) == 502
    with pytest.raises(ValueError, match="maximum context length is 512 tokens.*requested 513 tokens"):
        resolve_max_tokens(10, 503, 512, must_fit=True)
    with pytest.raises(ValueError, match="^max_completion_tokens must be at least 1, got 0"):
        resolve_max_tokens(10, 0, 512, name="max_completion_tokens")


def test_unknown_engine_argument(llama_dir: str) -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        LLM(llama_dir, max_batch_size=4)


# ---- checkpoints -----------------------------------------------------------------------------
def _safetensors(d: Path) -> Path:
    (path,) = d.glob("*.safetensors")
    return path


def _rewrite_header(d: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    path = _safetensors(d)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = edit(json.loads(raw[8:8 + n]))
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _shrunk(offsets: list[int]) -> list[int]:
    return [offsets[0], offsets[1] - 8]  # the shape stays: the bytes no longer match it


def _drop_tensor(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _safetensors(d)
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})


def _reshape_tensor(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _safetensors(d)
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _truncate(d: Path) -> None:
    path = _safetensors(d)
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def _remove_tokenizer(d: Path) -> None:
    for f in d.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()


CORRUPTIONS: dict[str, tuple[Callable[[Path], Any], str]] = {
    "no-config": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "config-not-json": (lambda d: (d / "config.json").write_text("{oops"), "cannot read"),
    "config-missing-field": (lambda d: _edit_config(d, hidden_size=None), "hidden_size"),
    "unknown-architecture": (lambda d: _edit_config(d, architectures=["GPTNeoXForCausalLM"]),
                             f"GPTNeoXForCausalLM.*supported: {SUPPORTED}"),
    "no-architectures": (lambda d: _edit_config(d, architectures=None), f"supported: {SUPPORTED}"),
    "no-safetensors": (lambda d: _safetensors(d).unlink(), "no \\*.safetensors"),
    "truncated": (_truncate, "truncated"),
    "tiny-file": (lambda d: _safetensors(d).write_bytes(b"\x01\x02"), "too short"),
    "header-too-long": (lambda d: _safetensors(d).write_bytes(struct.pack("<Q", 10**9) + b"{}"), "header"),
    "header-not-json": (lambda d: _safetensors(d).write_bytes(struct.pack("<Q", 6) + b"{nope!" + b"\0" * 64),
                        "header"),
    "header-not-object": (lambda d: _rewrite_header(d, lambda h: [1, 2]), "corrupt"),
    "header-entry-bad": (lambda d: _rewrite_header(d, lambda h: {**h, "model.norm.weight": {"shape": [64]}}),
                         "corrupt"),
    "header-bad-dtype": (lambda d: _rewrite_header(d, lambda h: {
        **h, "model.norm.weight": {**h["model.norm.weight"], "dtype": "Q4"}}), "model.norm.weight"),
    "header-bad-size": (lambda d: _rewrite_header(d, lambda h: {**h, "model.norm.weight": {
        **h["model.norm.weight"], "data_offsets": _shrunk(h["model.norm.weight"]["data_offsets"])}}),
        "model.norm.weight"),
    "missing-tensor": (_drop_tensor, "missing weights.*layers.1.mlp"),
    "wrong-shape": (_reshape_tensor, "shape"),
    "no-tokenizer": (_remove_tokenizer, "tokenizer"),
}


CAST = ["header-bad-size", "truncated", "wrong-shape"]  # also read through a dtype cast


@pytest.mark.parametrize(("name", "dtype"), [(n, "float32") for n in CORRUPTIONS] + [(n, "bfloat16") for n in CAST])
def test_broken_checkpoint_is_a_clear_error(llama_dir: str, tmp_path: Path, name: str, dtype: str) -> None:
    corrupt, message = CORRUPTIONS[name]
    d = tmp_path / "model"
    shutil.copytree(llama_dir, d)
    corrupt(d)
    with pytest.raises(ValueError, match=message):
        LLM(str(d), dtype=dtype, kv_cache_memory="16MiB")


def test_model_path_that_is_not_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    for path in (str(f), str(tmp_path / "nope")):
        with pytest.raises(ValueError, match="not a directory"):
            LLM(path)


# ---- CLI -------------------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=120)


def assert_one_error_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenmill: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    for needle in needles:
        assert needle in lines[0]


def test_cli_missing_model_is_one_error_line() -> None:
    assert_one_error_line(run_cli("generate", "--model", "/nonexistent", "hi"), "/nonexistent")

