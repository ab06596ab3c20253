"""`tokenmill serve --otlp-traces-endpoint`: a request's spans reach an OTLP/HTTP receiver on 127.0.0.1
(a tiny one here, decoding the protobuf with opentelemetry-proto); without the libraries the flag is
refused in one line."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tests.entrypoints.server import RemoteServer, free_port
from tokenmill.entrypoints.cli import main

pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2",
                    reason="the otel extra is not installed (pip install '.[dev]')")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402


class Receiver:
    """Collects the span names of every OTLP/HTTP protobuf export POSTed to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, bytes, bytes]] = []  # (name, trace id, parent span id)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        receiver.spans += [(s.name, s.trace_id, s.parent_span_id) for s in ss.spans]
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.http = HTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1/traces"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.http.shutdown()


def test_spans_reach_an_otlp_receiver(llama_dir: str, receiver: Receiver) -> None:
    srv = RemoteServer(llama_dir, "--served-model-name", "tiny", "--otlp-traces-endpoint", receiver.url)
    try:
        with srv.client() as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi there", "max_tokens": 5,
                                                "ignore_eos": True})
            assert r.status_code == 200
    finally:
        assert srv.stop() == 0  # the exit flushes the batched spans
    names = sorted(name for name, _, _ in receiver.spans)
    assert names == ["decode", "detokenize", "llm_request", "prefill", "queue"]
    assert len({trace for _, trace, _ in receiver.spans}) == 1
    assert all(parent for name, _, parent in receiver.spans if name != "llm_request")


def test_the_flag_without_the_libraries_is_one_line(llama_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    assert main(["serve", llama_dir, "--otlp-traces-endpoint", "http://127.0.0.1:9/v1/traces"]) == 2
    err = capsys.readouterr().err
    assert "needs the OpenTelemetry libraries" in err and "tokenmill[otel]" in err and "Traceback" not in err


def test_bad_slo_is_refused_before_loading(llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", llama_dir, "--slo", "ttft=5"]) == 2
    assert "--slo" in capsys.readouterr().err
