"""Speculative decoding through `tokenmill serve --speculative-config`: the same text as the offline
engine without speculation; OpenAI's Predicted Outputs drafts for its request, streams deltas of
several tokens with the same text, and reports accepted/rejected prediction tokens in the usage; the
spec_decode counters in /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.entrypoints.server import RemoteServer
from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.openai.serving_chat import prediction_matches

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
PROMPT = "def main(): return main() and main() or"


@pytest.fixture(scope="module")
def spec_server(llama_dir: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(llama_dir, "--served-model-name", "tiny", "--dtype", "float32", "--num-threads", "1",
                       "--speculative-config", json.dumps(SPEC))
    try:
        yield srv
    finally:
        srv.stop()


def test_completions_are_the_offline_engines_without_speculation(spec_server: RemoteServer, llama_dir: str) -> None:
    with spec_server.client() as c:
        got = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 24,
                                              "temperature": 0, "ignore_eos": True}).json()
    llm = LLM(llama_dir, dtype="float32", num_threads=1, kv_cache_memory="8MiB", max_model_len=512)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert got["choices"][0]["text"] == want[0].outputs[0].text


def test_predicted_outputs_draft_stream_several_tokens_a_delta_and_are_reported(spec_server: RemoteServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "say something"}], "max_tokens": 30,
            "temperature": 0, "ignore_eos": True}
    with spec_server.client() as c:
        plain = c.post("/v1/chat/completions", json=body).json()
        text = plain["choices"][0]["message"]["content"]
        assert "completion_tokens_details" not in plain["usage"] or not plain["usage"]["completion_tokens_details"]
        predicted = {**body, "prediction": {"type": "content", "content": text}}
        done = c.post("/v1/chat/completions", json=predicted).json()
        assert done["choices"][0]["message"]["content"] == text
        details = done["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] >= 1
        chunks = []
        with c.stream("POST", "/v1/chat/completions", json={**predicted, "stream": True, "logprobs": True,
                                                            "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        metrics = c.get("/metrics").text
    streamed = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert streamed == text
    sizes = [len(ch["choices"][0]["logprobs"]["content"]) for ch in chunks
             if ch["choices"] and ch["choices"][0].get("logprobs")]
    assert max(sizes) > 1  # a delta carried an accepted run
    assert chunks[-1]["usage"]["completion_tokens_details"] == details
    accepted = [ln for ln in metrics.splitlines() if ln.startswith("tokenmill:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0
    assert "tokenmill:spec_decode_num_drafts_total" in metrics
    assert 'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in metrics
    assert "tokenmill:spec_decode_mean_accepted_length" in metrics


def test_prediction_matches_counts_the_predictions_tokens_in_the_completion() -> None:
    assert prediction_matches([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert prediction_matches([1, 2, 3, 4], [1, 2, 9, 3, 4, 5]) == 4
    assert prediction_matches([1, 2, 3, 4], [7, 8]) == 0
