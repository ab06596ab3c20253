"""bad_words_token_ids: a banned sequence never appears in the output, and the output is the unbanned
greedy one up to the step where it would have; a one-token word is banned everywhere."""

from __future__ import annotations

import pytest

from tests.conftest import random_prompts
from tests.fixtures import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.worker.sampler import bad_word_bans


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bans_follow_the_output_tail() -> None:
    words = [[7], [1, 2], [3, 4, 5]]
    assert bad_word_bans(words, []) == [7]
    assert bad_word_bans(words, [9, 1]) == [7, 2]
    assert bad_word_bans(words, [3, 4]) == [7, 5]
    assert bad_word_bans(words, [4]) == [7]


@pytest.mark.parametrize("length", [1, 2, 3])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_banned_sequence_never_appears(llama_dir: str, length: int, async_scheduling: bool) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="2MiB", async_scheduling=async_scheduling)
    prompt = random_prompts(1, 10, 10, seed=3)[0]
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    end = 6  # ban the sequence that ends at output position 6
    word = ref[end - length + 1:end + 1]
    first = next(i for i in range(len(word) - 1, len(ref)) if ref[i - len(word) + 1:i + 1] == word)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words_token_ids=[word])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out[:first] == ref[:first] and out[first] != ref[first]
    assert not contains(out, word)


@pytest.mark.parametrize("length", [1, 2, 3])
def test_bad_words_match_transformers(llama_dir: str, length: int) -> None:
    # the words end inside the output and their prefixes are not at the end of the prompt, where
    # transformers (which looks at prompt and output) and this engine (output only, as vLLM) would differ
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="2MiB")
    prompt = random_prompts(1, 10, 10, seed=4)[0]
    ref = hf_greedy(llama_dir, prompt, 20)
    word = ref[6 - length + 1:7]
    assert prompt[len(prompt) - length + 1:] != word[:-1] or length == 1
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words_token_ids=[word])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy(llama_dir, prompt, 20, bad_words_ids=[word])
