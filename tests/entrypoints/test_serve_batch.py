"""The Files and Batch API against the real `openai` client on `tokenmill serve` (the demo model, float32
so that greedy answers do not depend on how requests are batched): every route, a 500-line batch answered
once per custom_id and equal to the same requests sent online, malformed lines in the error file, bad
uploads as 400s, owner scoping between two API keys, expiry, cancel, and kill -9 mid-batch then restart
(the last test: it restarts the module's server on the same --batch-dir); and `tokenmill run-batch`."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.server import RemoteServer

DEMO = str(Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo")
ALICE, BOB = "alice-key", "bob-key"
MAX_FILE_BYTES = 200_000
FINAL = ("completed", "failed", "expired", "cancelled")
REQUEST_TIMEOUT = 2.5  # online requests' limit; a batch line has none (its completion_window bounds it)


class Server:
    """The module's server and its batch directory, which outlives a restart."""

    def __init__(self, batch_dir: str) -> None:
        self.batch_dir = batch_dir
        self.remote = self._start()

    def _start(self) -> RemoteServer:
        return RemoteServer(DEMO, "--dtype", "float32", "--api-key", ALICE, "--api-key", BOB,
                            "--batch-dir", self.batch_dir, "--max-batch-file-bytes", str(MAX_FILE_BYTES),
                            "--max-num-seqs", "32",
                            "--served-model-name", "demo", "--request-timeout", str(REQUEST_TIMEOUT))

    def restart(self) -> None:
        self.remote = self._start()

    def client(self, key: str = ALICE) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.remote.url}/v1", api_key=key, max_retries=0, timeout=60)

    def http(self, key: str = ALICE) -> httpx.Client:
        return httpx.Client(base_url=self.remote.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(str(tmp_path_factory.mktemp("batches")))
    yield srv
    srv.remote.stop()


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def completion(i: int, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": "demo", "prompt": f"KING {i}.\nWhat news", "max_tokens": max_tokens,
            "temperature": 0, **extra}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def submit(client: openai.OpenAI, lines: list[Any], endpoint: str = "/v1/completions",
           window: str = "24h") -> Any:
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window)  # type: ignore[arg-type]


def wait(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = FINAL, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def records(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_500_line_batch_every_route_and_equal_to_online(server: Server) -> None:
    client = server.client()
    lines = [line(f"req-{i}", completion(i)) for i in range(500)]
    f = client.files.create(file=("five-hundred.jsonl", jsonl(lines)), purpose="batch")
    assert (f.object, f.purpose, f.filename, f.bytes) == ("file", "batch", "five-hundred.jsonl", len(jsonl(lines)))
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == jsonl(lines)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "five-hundred"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "five-hundred"}
    online = {}
    with ThreadPoolExecutor(16) as pool:  # the same requests online, while the batch runs
        for i, out in enumerate(pool.map(lambda i: client.completions.create(**completion(i)), range(500))):
            online[f"req-{i}"] = out.choices[0].text
    done = wait(client, batch.id)
    assert done.status == "completed", done
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (500, 500, 0)
    out = records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(online)  # every custom_id answered once
    for r in out:
        assert r["error"] is None and r["id"].startswith("batch_req_")
        assert r["response"]["status_code"] == 200
        assert r["response"]["body"]["choices"][0]["text"] == online[r["custom_id"]], r["custom_id"]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    # list: newest first, pages by after/limit
    others = [submit(client, [line("x", completion(0, 1))]).id for _ in range(2)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == others[::-1] and page.has_more
    assert [b.id for b in client.batches.list(limit=2, after=others[0]).data][0] == batch.id
    assert batch.id in [b.id for b in client.batches.list(limit=1)]  # iterating fetches every page
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_chat_batch_equals_online_and_embeddings_lines_say_why(server: Server) -> None:
    client = server.client()
    messages = [[{"role": "user", "content": f"Good morrow {i}"}] for i in range(8)]
    bodies = [{"model": "demo", "messages": m, "max_tokens": 6, "temperature": 0} for m in messages]
    batch = wait(client, submit(client, [line(f"chat-{i}", b, "/v1/chat/completions") for i, b in enumerate(bodies)],
                                "/v1/chat/completions").id)
    answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
               for r in records(client, batch.output_file_id)}
    assert answers == {f"chat-{i}": client.chat.completions.create(**b).choices[0].message.content  # type: ignore[call-overload]
                       for i, b in enumerate(bodies)}
    emb = wait(client, submit(client, [line("e", {"model": "demo", "input": "hi"}, "/v1/embeddings")],
                              "/v1/embeddings").id)
    assert emb.status == "completed" and emb.request_counts.failed == 1
    [err] = records(client, emb.error_file_id)
    assert err["response"]["status_code"] == 400 and "--runner pooling" in err["response"]["body"]["error"]["message"]


def test_malformed_lines_go_to_the_error_file(server: Server) -> None:
    client = server.client()
    lines: list[Any] = [
        line("good", completion(1)),
        "{not json",
        line("wrong-endpoint", completion(2), "/v1/chat/completions"),
        line("unknown-model", {**completion(3), "model": "nope"}),
        line("oversize", completion(4) | {"prompt": "word " * 2000}),
        line("good", completion(5)),  # a duplicate custom_id
        {"method": "POST", "url": "/v1/completions", "body": completion(6)},  # no custom_id
        line("streaming", completion(7, stream=True)),
        line("bad-value", completion(8, temperature=-1)),
    ]
    batch = wait(client, submit(client, lines).id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (9, 1, 8)
    [ok] = records(client, batch.output_file_id)
    assert ok["custom_id"] == "good"
    errors = records(client, batch.error_file_id)
    assert len(errors) == 8

    def why(r: dict[str, Any]) -> tuple[Any, Any]:
        if r["response"] is None:
            return r["error"]["code"], None
        return r["response"]["status_code"], r["response"]["body"]["error"]["code"]

    by_id = {r["custom_id"]: why(r) for r in errors if r["custom_id"] not in (None, "good")}
    assert by_id == {"wrong-endpoint": ("invalid_url", None), "unknown-model": (404, "model_not_found"),
                     "oversize": (400, "context_length_exceeded"), "streaming": ("unsupported_parameter", None),
                     "bad-value": (400, "invalid_value")}
    nameless = sorted(why(r)[0] for r in errors if r["custom_id"] is None)
    assert nameless == ["invalid_json", "invalid_request"]
    assert [why(r)[0] for r in errors if r["custom_id"] == "good"] == ["duplicate_custom_id"]
    assert all(r["response"] is not None or r["error"]["message"] for r in errors)


@pytest.mark.parametrize(("content", "purpose", "code", "param"), [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "batch", "invalid_file", "file"),
    (b"[1, 2, 3]\n", "batch", "invalid_file", "file"),
    (b"", "batch", "invalid_file", "file"),
    (b'{"custom_id": "a"}\n' * (MAX_FILE_BYTES // 10), "batch", "file_too_large", "file"),
    (b'{"custom_id": "a"}\n', "fine-tune", "invalid_value", "purpose"),
])
def test_bad_uploads_are_400s(server: Server, content: bytes, purpose: str, code: str, param: str) -> None:
    with server.http() as http:
        r = http.post("/v1/files", files={"file": ("x.jsonl", content)}, data={"purpose": purpose})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]


def test_bad_batch_requests(server: Server) -> None:
    client = server.client()
    f = client.files.create(file=("in.jsonl", jsonl([line("a", completion(0))])), purpose="batch")
    with server.http() as http:
        for body, status, code, param in (
                ({"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"}, 404,
                 "file_not_found", "input_file_id"),
                ({"input_file_id": f.id, "endpoint": "/v1/images", "completion_window": "24h"}, 400, "invalid_value",
                 "endpoint"),
                ({"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "soon"}, 400,
                 "invalid_value", "completion_window"),
                ({"endpoint": "/v1/completions"}, 400, "invalid_request", "input_file_id")):
            r = http.post("/v1/batches", json=body)
            assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (status, code, param)
        assert http.get("/v1/batches/batch_nope").status_code == 404
        assert http.post("/v1/files", data={"purpose": "batch"}).json()["error"]["param"] == "file"
    done = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                              completion_window="24h").id)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(done.id)


def test_files_and_batches_belong_to_their_key(server: Server) -> None:
    alice, bob = server.client(ALICE), server.client(BOB)
    f = alice.files.create(file=("mine.jsonl", jsonl([line("a", completion(0))])), purpose="batch")
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    for call in (lambda: bob.files.retrieve(f.id), lambda: bob.files.content(f.id), lambda: bob.files.delete(f.id),
                 lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    bobs = bob.files.create(file=("his.jsonl", jsonl([line("b", completion(0))])), purpose="batch")
    assert [x.id for x in bob.files.list()] == [bobs.id] and not bob.batches.list().data
    assert bobs.id not in [x.id for x in alice.files.list()]
    assert wait(alice, batch.id).status == "completed"
    assert alice.files.retrieve(f.id).id == f.id
    with pytest.raises(openai.AuthenticationError):
        server.client("mallory").files.list()
    db = sqlite3.connect(os.path.join(server.batch_dir, "batches.sqlite3"))
    owners = {row[0] for row in db.execute("SELECT owner FROM files UNION SELECT owner FROM batches")}
    db.close()
    assert len(owners) == 2 and not owners & {ALICE, BOB}  # hashes of the keys, never the keys


def long_lines(n: int, short: int = 0) -> list[dict[str, Any]]:
    """`short` one-token lines first, then n lines that run long (ignore_eos)."""
    return ([line(f"short-{i}", completion(i, 1)) for i in range(short)]
            + [line(f"long-{i}", completion(i, 400, ignore_eos=True)) for i in range(n)])


def test_expiry_keeps_the_finished_lines(server: Server) -> None:
    client = server.client()
    batch = submit(client, long_lines(100, short=5), window="4s")  # longer than --request-timeout
    done = wait(client, batch.id)
    assert done.status == "expired" and done.expired_at and done.completed_at is None
    out, err = records(client, done.output_file_id), records(client, done.error_file_id)
    assert {r["custom_id"] for r in out} >= {f"short-{i}" for i in range(5)}
    assert sorted(r["custom_id"] for r in out + err) == sorted(x["custom_id"] for x in long_lines(100, short=5))
    assert all(r["error"]["code"] == "batch_expired" for r in err)  # none of them timed out (408) first
    counts = done.request_counts
    assert (counts.total, counts.completed + counts.failed, counts.completed) == (105, 105, len(out))
    assert_engine_idle(server)


def test_cancel(server: Server) -> None:
    client = server.client()
    batch = submit(client, long_lines(100, short=3))
    wait(client, batch.id, ("in_progress",))
    while client.batches.retrieve(batch.id).request_counts.completed < 3:
        time.sleep(0.1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert {r["custom_id"] for r in records(client, done.output_file_id)} >= {"short-0", "short-1", "short-2"}
    assert done.request_counts.completed < 103
    assert_engine_idle(server)


def assert_engine_idle(server: Server) -> None:
    """The lines a batch stopped are aborted in the engine, their KV freed."""
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{server.remote.url}/metrics").text
        running = [ln for ln in text.splitlines() if ln.startswith(("tokenmill:num_requests_running",
                                                                      "tokenmill:num_requests_waiting"))]
        if all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in running):
            return
        assert time.monotonic() < deadline, running
        time.sleep(0.1)


def run_batch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "run-batch", *args, "--model", DEMO,
                           "--served-model-name", "demo", "--dtype", "float32", "--kv-cache-memory", "64MiB",
                           "--max-model-len", "512"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TOKENMILL_API_KEY": ""})


def test_run_batch_resumes_and_equals_online(server: Server, tmp_path: Path) -> None:
    """`tokenmill run-batch` resumed from an output file a kill cut short: its answered custom_ids are
    skipped, its cut last line dropped; the answers equal the server's greedy ones."""

    def body(i: int) -> dict[str, Any]:
        return completion(i, 5)

    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body(i)} for i in range(40)]
    lines.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "demo", "messages": [{"role": "user", "content": "Hail"}], "max_tokens": 4}})
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {**body(0), "model": "x"}})
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # an earlier run answered r0..r9 (marked, so a rerun of them would show) and was killed mid-line
    earlier = [{"id": "old", "custom_id": f"r{i}", "response": {"status_code": 200, "body": "earlier"}, "error": None}
               for i in range(10)]
    out.write_text("".join(json.dumps(x) + "\n" for x in earlier) + '{"id": "cut", "custom_id": "r10", "resp')
    result = run_batch("-i", str(src), "-o", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "32 lines answered (1 errors), 10 skipped" in result.stdout
    records = [json.loads(x) for x in out.read_text().splitlines()]
    ids = [r["custom_id"] for r in records]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)  # each once
    assert records[:10] == earlier
    by_id = {r["custom_id"]: r for r in records}
    assert by_id["bad"]["response"]["status_code"] == 404
    assert by_id["chat"]["response"]["body"]["choices"][0]["message"]["content"]
    with server.http() as http:
        online = [http.post("/v1/completions", json=body(i)).json()["choices"][0]["text"] for i in range(10, 40)]
    assert [by_id[f"r{i}"]["response"]["body"]["choices"][0]["text"] for i in range(10, 40)] == online


def test_kill_9_mid_batch_then_restart_loses_and_repeats_nothing(server: Server) -> None:
    client = server.client()
    lines = [line(f"k-{i}", completion(i, 8, ignore_eos=True)) for i in range(120)]
    batch = submit(client, lines)
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 30:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(server.remote.proc.pid, signal.SIGKILL)  # the server and its engine core, mid-batch
    server.remote.proc.wait(10)
    server.restart()  # the same --batch-dir: the batch resumes by itself
    client = server.client()
    done = wait(client, batch.id)
    assert done.status == "completed", done
    out = records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(x["custom_id"] for x in lines)  # none lost, none twice
    assert (done.request_counts.completed, done.request_counts.failed) == (120, 0)
    sample = out[::20]  # greedy answers from before and after the crash equal online ones
    with server.http() as http:
        online = [http.post("/v1/completions", json=completion(int(r["custom_id"][2:]), 8, ignore_eos=True)).json()
                  for r in sample]
    assert [r["response"]["body"]["choices"][0]["text"] for r in sample] == [o["choices"][0]["text"] for o in online]
