"""`use_beam_search` on /v1/completions (vLLM's extra): the n best beams of each prompt, as
`LLM.beam_search` (itself checked against transformers' beam search) gives them; searches whose
clients leave keep no KV block (the beams' kept and shared blocks are all released)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import random_prompts
from tests.entrypoints.conftest import FLOAT32_NAME as NAME
from tests.entrypoints.server import RemoteServer
from tests.entrypoints.test_serve_openai import wait_until_idle_and_free
from tokenmill import LLM, BeamSearchParams

PROMPTS = random_prompts(2, 4, 20, seed=21)


@pytest.fixture
def server(float32_server: RemoteServer) -> RemoteServer:
    return float32_server


def test_beam_search_answers_the_n_best_beams(server: RemoteServer, llama_dir: str) -> None:
    body = {"model": NAME, "prompt": PROMPTS, "max_tokens": 6, "n": 3, "use_beam_search": True,
            "length_penalty": 0.5, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", max_model_len=512)
    expected = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                               BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.5))
    tokenizer = llm.get_tokenizer()
    want = [tokenizer.decode(s.output_token_ids) for out in expected for s in out.sequences[:3]]
    assert [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])] == want
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 2 * 3 * 6


@pytest.mark.parametrize("extra", [{"stream": True}, {"echo": True}, {"n": 64}])
def test_beam_search_refuses_what_it_cannot_do(server: RemoteServer, extra: dict[str, object]) -> None:
    body = {"model": NAME, "prompt": "hello", "max_tokens": 4, "use_beam_search": True, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] is not None


def test_searches_whose_clients_leave_free_every_block(server: RemoteServer) -> None:
    async def impatient(http: httpx.AsyncClient, i: int) -> None:
        # nearly the tiny model's whole length (512 positions) in 8 beams, four searches beside each other: 480
        # steps of 32 rows, which outlast these timeouts on a fast CPU too
        body = {"model": NAME, "prompt": PROMPTS[i % 2], "max_tokens": 480, "n": 8, "use_beam_search": True,
                "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3 + 0.1 * i))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers) as http:
            await asyncio.gather(*[impatient(http, i) for i in range(4)])

    asyncio.run(run())
    wait_until_idle_and_free(server, 30)
    body = {"model": NAME, "prompt": "hello", "max_tokens": 3, "n": 2, "use_beam_search": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
