"""`tokenmill serve` on the real all-MiniLM-L6-v2 (an embedding server, picked from the checkpoint):
/v1/embeddings through the clients users bring (the openai SDK, float and base64; LangChain's
OpenAIEmbeddings; LiteLLM's embedding) equal to sentence-transformers' encode, its errors in the OpenAI
schema, concurrent requests batched, and each kind of server saying how to start the other."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.entrypoints.server import RemoteServer
from tests.entrypoints.test_clients import loopback_only  # noqa: F401  (the module's autouse guard)

KEY = "sk-embed"
NAME = "minilm"
TEXTS = ["hello world", "A man is eating food.", "The quick brown fox jumps over the lazy dog. " * 6,
         "Embeddings map text to vectors whose cosine similarity reflects meaning. " * 15]


@pytest.fixture(scope="module")
def server(minilm: str, loopback_only: list[str]) -> Iterator[RemoteServer]:  # noqa: F811
    srv = RemoteServer(minilm, "--served-model-name", NAME, "--embed-batch-wait-ms", "20", api_key=KEY)
    yield srv
    assert srv.stop() == 0  # SIGTERM drains and exits 0


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(minilm: str) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm, device="cpu").encode(TEXTS, convert_to_tensor=True)


def check_close(vectors: list[list[float]], reference: torch.Tensor) -> None:
    assert F.cosine_similarity(torch.tensor(vectors), reference).min() >= 0.9999


def test_embeddings_batch_equals_sentence_transformers(client: openai.OpenAI, reference: torch.Tensor) -> None:
    """The embedding server runs /v1/embeddings batches (the Files and Batch API) through the same route."""
    import json
    import time

    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": NAME, "input": text, "encoding_format": "float"}} for i, text in enumerate(TEXTS)]
    f = client.files.create(file=("e.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(TEXTS)
    out = {r["custom_id"]: r for r in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    check_close([out[f"e{i}"]["response"]["body"]["data"][0]["embedding"] for i in range(len(TEXTS))], reference)


def test_openai_sdk_float_and_base64(client: openai.OpenAI, reference: torch.Tensor) -> None:
    # no encoding_format: the SDK asks for base64 and decodes it itself
    for r in (client.embeddings.create(model=NAME, input=TEXTS),
              client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")):
        assert [d.index for d in r.data] == [0, 1, 2, 3] and r.model == NAME
        check_close([d.embedding for d in r.data], reference)
        assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    raw = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() for d in raw.data]  # type: ignore[arg-type]
    check_close(decoded, reference)
    one = client.embeddings.create(model=NAME, input=TEXTS[0])
    check_close([one.data[0].embedding], reference[:1])


def test_token_id_inputs(server: RemoteServer, client: openai.OpenAI) -> None:
    ids = [101, 7592, 2088, 102]  # "[CLS] hello world [SEP]" in MiniLM's vocabulary
    by_ids = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    by_lists = client.embeddings.create(model=NAME, input=[ids, ids[:3]], encoding_format="float")
    by_text = client.embeddings.create(model=NAME, input="hello world", encoding_format="float")
    assert by_ids.usage.prompt_tokens == 4 and by_lists.usage.prompt_tokens == 7
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), torch.tensor(by_text.data[0].embedding))
    torch.testing.assert_close(torch.tensor(by_lists.data[0].embedding), torch.tensor(by_ids.data[0].embedding))


def test_concurrent_requests_are_batched(client: openai.OpenAI, reference: torch.Tensor) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.embeddings.create, model=NAME, input=TEXTS[i % 4], encoding_format="float")
                   for i in range(16)]
        results = [f.result() for f in futures]
    for i, r in enumerate(results):
        check_close([r.data[0].embedding], reference[i % 4:i % 4 + 1])


def errors_of(server: RemoteServer, body: dict[str, Any], path: str = "/v1/embeddings") -> tuple[int, dict[str, Any]]:
    with server.client() as http:
        r = http.post(path, json=body)
    return r.status_code, r.json()["error"]


def test_errors_in_the_openai_schema(server: RemoteServer) -> None:
    long_text = "word " * 600  # the server runs with --max-model-len 512 (RemoteServer)
    cases = [
        ({"input": "hi", "dimensions": 8}, "dimensions", "matryoshka"),
        ({"input": long_text}, "input", "maximum context length is 512"),
        ({"input": []}, "input", "input"),
        ({"input": [""]}, "input", ""),
        ({"input": [[40000]]}, "input", "out of vocabulary"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "hi", "model": "other"}, "model", "does not exist"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
        ({"input": "hi", "temperature": 1}, "temperature", "Unrecognized"),
    ]
    for body, param, text in cases:
        status, error = errors_of(server, body)
        assert status in (400, 404), (body, error)
        assert error["param"] == param and text in error["message"], (body, error)
        assert set(error) == {"message", "type", "param", "code"}
    with server.client() as http:
        r = http.post("/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 512
    status, error = errors_of(server, {"prompt": "hi", "max_tokens": 2}, "/v1/completions")
    assert status == 400 and "--runner generate" in error["message"]


def test_the_generating_server_says_how_to_start_an_embedding_server(float32_server: RemoteServer) -> None:
    status, error = errors_of(float32_server, {"input": "hi"})
    assert status == 400 and "--runner pooling" in error["message"]


def test_langchain_openai_embeddings(server: RemoteServer, reference: torch.Tensor) -> None:
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(base_url=f"{server.url}/v1", api_key=KEY, model=NAME,  # type: ignore[arg-type]
                           check_embedding_ctx_length=False, max_retries=0)
    check_close(emb.embed_documents(TEXTS), reference)
    check_close([emb.embed_query(TEXTS[1])], reference[1:2])


def test_litellm_embedding(server: RemoteServer, reference: torch.Tensor) -> None:
    import litellm

    litellm.telemetry = False
    r = litellm.embedding(model=f"openai/{NAME}", input=TEXTS, api_base=f"{server.url}/v1", api_key=KEY,
                          num_retries=0, timeout=60)
    check_close([d["embedding"] for d in r.data], reference)
    assert r.usage.prompt_tokens > len(TEXTS)
