"""Incremental detokenization (byte-level BPE and SentencePiece byte-fallback) and stop strings
through the engine, streamed as deltas."""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import random_prompts
from tokenmill import LLM, RequestOutput, SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from tokenmill.sampling_params import RequestOutputKind

MISTRAL_COMMON = "mistral_common==1.13.1"
SP_MEMBER = "mistral_common/data/tokenizer.model.v1"
TEXTS = [
    "Héllo wörld: naïve café, crème brûlée, Ærøskøbing, señor, Zürich.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji 👋🏽 🇫🇷 👨‍👩‍👧 🎉🎉 and ✓ ✗ → ∑ ∞ ≠ done",
    "def f(x):\n    return 'ünïcödé'  # 🐍 λ\n\tprint(\"ok\")  ",
]
ALPHABET = "abc XYZ019.,:\n\téüñßøçÆ—€™✓→∞日本語中文한국🎉👋🏽🇫🇷👨‍👩‍👧🐍"


@pytest.fixture(scope="module")
def bpe(tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Mistral v1's SentencePiece model (byte fallback), from the mistral_common wheel on PyPI,
    converted to a fast tokenizer once per session."""
    missing = [m for m in ("sentencepiece", "google.protobuf") if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        pytest.fail(f"converting tokenizer.model needs {missing} (install the dev extras)")
    root = tmp_path_factory.mktemp("mistral_sp")
    dl = root / "dl"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", MISTRAL_COMMON,
                           "-d", str(dl)], capture_output=True, text=True, timeout=300)
    wheels = glob.glob(str(dl / "mistral_common-1.13.1-*.whl"))
    if proc.returncode != 0 or not wheels:
        pytest.skip(f"cannot download {MISTRAL_COMMON} from the package index (offline?): "
                    f"{proc.stderr.strip()[-300:]}")
    from transformers import AutoTokenizer, LlamaTokenizer

    src, out = root / "sp", root / "fast"
    os.makedirs(src)
    (src / "tokenizer.model").write_bytes(zipfile.ZipFile(wheels[0]).read(SP_MEMBER))
    (src / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    LlamaTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_ids_to_tokens(tok("👋", add_special_tokens=False).input_ids)[-4:] == [
        "<0xF0>", "<0x9F>", "<0x91>", "<0x8B>"]  # byte fallback is what this test is about
    return tok


def stream(tok: Any, prompt: list[int], output: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    return [detok.add_tokens([t]) for t in output]


def check_all_splits(tok: Any, ids: list[int]) -> int:
    """For every split into prompt + output whose prompt decodes to a prefix of the whole,
    the streamed output must equal the rest of the full decode. Returns the splits checked."""
    full = tok.decode(ids, skip_special_tokens=True)
    checked = 0
    for split in range(1, len(ids)):
        prompt_text = tok.decode(ids[:split], skip_special_tokens=True)
        if not full.startswith(prompt_text):
            continue  # the prompt ends inside a character: no text is "the prompt's"
        deltas = stream(tok, ids[:split], ids[split:])
        assert "".join(deltas) == full[len(prompt_text):], split
        assert not any("\ufffd" in d for d in deltas)
        checked += 1
    return checked


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decoder_is_tokenizer_decode(bpe: Any, sentencepiece: Any, skip: bool) -> None:
    """The backend shortcut gives tokenizer.decode's text, special tokens included or skipped; a
    tokenizer that cleans up spaces keeps its own decode."""
    for tok in (bpe, sentencepiece):
        assert not tok.clean_up_tokenization_spaces  # so the shortcut is the one under test
        ids = [tok.bos_token_id or 0] + tok(" ".join(TEXTS), add_special_tokens=False).input_ids
        for n in (1, 2, 7, len(ids)):
            assert fast_decoder(tok, skip)(ids[:n]) == tok.decode(ids[:n], skip_special_tokens=skip)

    class CleansUp:
        clean_up_tokenization_spaces = True
        _tokenizer = bpe._tokenizer

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return f"own decode {len(ids)}"

    assert fast_decoder(CleansUp(), skip)([1, 2]) == "own decode 2"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_streams_multibyte_text_exactly(bpe: Any, text: str) -> None:
    ids = bpe(text).input_ids
    assert len(ids) > len(text) // 3  # multi-byte characters really are split over tokens
    assert check_all_splits(bpe, ids) >= 10


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("bos", [True, False])
def test_sentencepiece_byte_fallback_streams_text_exactly(sentencepiece: Any, text: str, bos: bool) -> None:
    ids = ([sentencepiece.bos_token_id] if bos else []) + sentencepiece(text, add_special_tokens=False).input_ids
    assert check_all_splits(sentencepiece, ids) >= 10


def test_long_streams_past_the_window(bpe: Any, sentencepiece: Any) -> None:
    text = " ".join(TEXTS) * 4  # hundreds of tokens: the detokenizer trims its window
    for tok in (bpe, sentencepiece):
        ids = tok(text, add_special_tokens=False).input_ids
        prompt, output = ids[:3], ids[3:]
        assert len(output) > 200
        full = tok.decode(ids)
        assert "".join(stream(tok, prompt, output)) == full[len(tok.decode(prompt)):]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=40), prefix=st.text(alphabet=ALPHABET, max_size=8))
def test_random_multibyte_text_streams_exactly(bpe: Any, sentencepiece: Any, text: str, prefix: str) -> None:
    for tok in (bpe, sentencepiece):
        prompt = tok("Q: " + prefix, add_special_tokens=False).input_ids
        output = tok(text, add_special_tokens=False).input_ids
        full = tok.decode(prompt + output)
        prompt_text = tok.decode(prompt)
        assert full.startswith(prompt_text)
        assert "".join(stream(tok, prompt, output)) == full[len(prompt_text):]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(output=st.lists(st.integers(2, 511), min_size=1, max_size=60))
def test_byte_level_bpe_streams_arbitrary_ids(bpe: Any, output: list[int]) -> None:
    """Any ids (as a random model emits them, broken UTF-8 included): the stream is the full
    decode, less a trailing incomplete character it is still waiting for."""
    prompt = bpe("ok 👋 ", add_special_tokens=False).input_ids
    full = bpe.decode(prompt + output)
    prompt_text = bpe.decode(prompt)
    assert "".join(stream(bpe, prompt, output)) == full[len(prompt_text):].rstrip("\ufffd")


# ---- stop strings through the engine ---------------------------------------------------------
@pytest.fixture(scope="module")
def llm(llama_dir: str) -> Iterator[LLM]:
    yield LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")


def run_engine(llm: LLM, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine = llm.engine
    rid = engine.add_request(None, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    kv = engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks  # a stop string frees the request's blocks
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> tuple[list[int], str, list[int]]:
    """A prompt, its greedy completion text, and the text offsets where streamed deltas begin."""
    prompt = random_prompts(1, 10, 10, seed=21)[0]
    deltas = run_engine(llm, prompt, GREEDY.clone(output_kind=RequestOutputKind.DELTA))
    text = "".join(o.outputs[0].text for o in deltas)
    offsets, at = set(), 0
    for o in deltas:
        offsets.add(at)
        at += len(o.outputs[0].text)
    return prompt, text, sorted(offsets)


def pick_stop(text: str, offsets: list[int], length: int, after: int = 4) -> tuple[str, int]:
    """A stop string that starts inside one delta and ends in a later one, first seen where it starts."""
    for p in range(after, len(text) - length):
        s = text[p:p + length]
        crosses = p not in offsets and any(p < o < p + length for o in offsets)
        if crosses and "\ufffd" not in s and text.find(s) == p:
            return s, p
    raise AssertionError(f"no stop string of length {length} crosses a token boundary in {text!r}")


@pytest.mark.parametrize("length", [2, 4])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_is_never_split_across_deltas(llm: LLM, reference: tuple[list[int], str, list[int]],
                                                  length: int, include: bool) -> None:
    prompt, text, offsets = reference
    stop, at = pick_stop(text, offsets, length)
    params = GREEDY.clone(stop=[stop], include_stop_str_in_output=include, output_kind=RequestOutputKind.DELTA)
    outs = run_engine(llm, prompt, params)
    expected = text[:at + len(stop)] if include else text[:at]
    streamed = ""
    for o in outs:
        streamed += o.outputs[0].text
        # what was handed out is never taken back: it is always a prefix of the final text
        assert expected.startswith(streamed)
    assert streamed == expected
    final = outs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    cumulative = run_engine(llm, prompt, GREEDY.clone(stop=[stop], include_stop_str_in_output=include))
    assert cumulative[-1].outputs[0].text == expected
    for earlier, later in zip(cumulative, cumulative[1:]):
        assert later.outputs[0].text.startswith(earlier.outputs[0].text)
    assert [t for o in outs for t in o.outputs[0].token_ids] == cumulative[-1].outputs[0].token_ids


def test_the_earliest_of_several_stop_strings_wins(llm: LLM, reference: tuple[list[int], str, list[int]]) -> None:
    prompt, text, offsets = reference
    early, at = pick_stop(text, offsets, 3, after=4)
    late, late_at = pick_stop(text, offsets, 2, after=at + 4)
    outs = run_engine(llm, prompt, GREEDY.clone(stop=[late, early], output_kind=RequestOutputKind.DELTA))
    assert "".join(o.outputs[0].text for o in outs) == text[:at]
    assert outs[-1].outputs[0].stop_reason == early and late_at > at


def test_held_back_text_is_released_when_no_stop_string_completes(
        llm: LLM, reference: tuple[list[int], str, list[int]]) -> None:
    prompt, text, _ = reference
    stop = text[5:8] + "\x07never"  # starts like the text, never completes
    outs = run_engine(llm, prompt, GREEDY.clone(stop=[stop], output_kind=RequestOutputKind.DELTA))
    assert "".join(o.outputs[0].text for o in outs) == text
    assert outs[-1].outputs[0].finish_reason == "length"


def test_engine_text_is_the_tokenizer_decode(llm: LLM, reference: tuple[list[int], str, list[int]]) -> None:
    prompt, text, _ = reference
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    full = tok.decode(prompt + out.token_ids, skip_special_tokens=True)
    assert out.text == text == full[len(tok.decode(prompt, skip_special_tokens=True)):].rstrip("\ufffd")
