"""vLLM's `prompt_logprobs`: per prompt position (None for the first) the actual token's logprob and
the top k, as the offline LLM gives them; on /v1/completions (streamed once per choice) and on chat
(not streamed, as in vLLM)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import random_prompts
from tests.entrypoints.conftest import FLOAT32_NAME as NAME
from tests.entrypoints.server import RemoteServer
from tokenmill import LLM, SamplingParams

PROMPT = random_prompts(1, 12, 12, seed=31)[0]


@pytest.fixture
def server(float32_server: RemoteServer) -> RemoteServer:
    return float32_server


def _expected(llama_dir: str) -> list[dict[int, float] | None]:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", max_model_len=512)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in out[0].prompt_logprobs or []]


def _as_ids(entries: list[dict[str, dict[str, float]] | None]) -> list[dict[int, float] | None]:
    return [None if e is None else {int(t): v["logprob"] for t, v in e.items()} for e in entries]


def test_prompt_logprobs_match_the_offline_engine(server: RemoteServer, llama_dir: str) -> None:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 3, "n": 2, "prompt_logprobs": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    expected = _expected(llama_dir)
    assert len(expected) == len(PROMPT) and expected[0] is None
    for choice in r.json()["choices"]:
        got = _as_ids(choice["prompt_logprobs"])
        assert [None if e is None else sorted(e) for e in got] == [None if e is None else sorted(e) for e in expected]
        for g, e in zip(got[1:], expected[1:], strict=True):
            assert g is not None and e is not None
            assert all(abs(g[t] - e[t]) < 1e-4 for t in e)
        assert all(1 <= len(e) <= 3 for e in got[1:] if e is not None)  # the actual token and the top 2


def test_prompt_logprobs_come_once_per_streamed_choice(server: RemoteServer) -> None:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 1, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    carrying = [c for chunk in chunks for c in chunk["choices"] if c.get("prompt_logprobs")]
    assert len(carrying) == 1 and len(carrying[0]["prompt_logprobs"]) == len(PROMPT)


def test_prompt_logprobs_are_bounded(server: RemoteServer) -> None:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 21}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_chat_answers_carry_the_prompt_logprobs(server: RemoteServer) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2,
            "prompt_logprobs": 1}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    entries = data["prompt_logprobs"]
    assert len(entries) == data["usage"]["prompt_tokens"] and entries[0] is None
    assert all(1 <= len(e) <= 2 and all("logprob" in v for v in e.values()) for e in entries[1:])
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                          headers=server.headers, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
