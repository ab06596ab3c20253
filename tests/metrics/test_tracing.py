"""OpenTelemetry spans of a request (metrics/tracing.py), exported through the SDK's in-memory exporter."""

from __future__ import annotations

import pytest

from tokenmill.metrics import EngineMetrics
from tokenmill.outputs import CompletionOutput, RequestOutput

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed (pip install '.[dev]')")

from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tokenmill.metrics.tracing import RequestTracer  # noqa: E402


def test_one_request_gives_queue_prefill_decode_detokenize_spans() -> None:
    exporter = InMemorySpanExporter()
    m = EngineMetrics("tiny")
    m.tracer = RequestTracer.with_processor(SimpleSpanProcessor(exporter), "tiny")
    m.request_added("r1", 100.0, 3)
    m.request_scheduled("r1", 100.2)
    for i, t in enumerate((100.5, 100.6, 100.7)):
        comp = CompletionOutput(0, "", [10 + i], finish_reason="length" if i == 2 else None)
        m.output(RequestOutput("r1", None, [1, 2, 3], [comp], i == 2), t)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode", "detokenize"}
    root = spans["llm_request"]
    for name in ("queue", "prefill", "decode", "detokenize"):
        assert spans[name].parent is not None and spans[name].parent.span_id == root.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id
    ns = 1e9
    assert (spans["queue"].start_time, spans["queue"].end_time) == (round(100.0 * ns), round(100.2 * ns))
    assert spans["prefill"].end_time == spans["decode"].start_time == pytest.approx(100.5 * ns, abs=1e3)
    assert spans["decode"].end_time == pytest.approx(100.7 * ns, abs=1e3)
    assert spans["detokenize"].start_time == pytest.approx(100.7 * ns, abs=1e3)
    assert root.attributes is not None
    assert root.attributes["gen_ai.usage.output_tokens"] == 3 and root.attributes["gen_ai.usage.input_tokens"] == 3
    assert root.attributes["gen_ai.request.id"] == "r1"
    assert root.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(0.5)
