"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`): one `llm_request` span per request with
four children, laid end to end from the times the API process records:

  queue       arrival -> the core first schedules it
  prefill     first scheduled -> its first token reaches the API process
  decode      first token -> last token
  detokenize  the API process's handling of the last step's output (detokenization, stop strings) up to
              the final output; `tokenmill.detokenize_seconds` sums that handling over every step

The spans are made when the request ends, with their real start and end times, and exported in batches
by the OpenTelemetry SDK (an optional extra: `pip install 'tokenmill[otel]'`, also in `.[dev]`).
Attributes follow the GenAI semantic conventions where they have a name (gen_ai.*)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INSTALL_HINT = "pip install 'tokenmill[otel]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"


def require_opentelemetry() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry libraries: {INSTALL_HINT}") from None


@dataclass
class RequestSpanTimes:
    """Seconds since the epoch (time.time()) of one request's milestones; None where it never got there."""

    request_id: str
    arrival: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float
    output_started: float | None  # when the API process began handling the last step's output
    detokenize_s: float
    prompt_tokens: int
    output_tokens: int
    finish_reason: str


def _ns(t: float) -> int:
    return round(t * 1e9)


class RequestTracer:
    def __init__(self, tracer: Any, model_name: str, provider: Any = None) -> None:
        self.tracer = tracer
        self.model_name = model_name
        self.provider = provider

    @classmethod
    def to_otlp(cls, endpoint: str, model_name: str) -> RequestTracer:
        require_opentelemetry()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        return cls.with_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)), model_name)

    @classmethod
    def with_processor(cls, processor: Any, model_name: str) -> RequestTracer:
        """A tracer of its own provider (never the process-global one) exporting through `processor`."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        provider = TracerProvider(resource=Resource.create({"service.name": "tokenmill"}))
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("tokenmill"), model_name, provider)

    def request_done(self, t: RequestSpanTimes) -> None:
        from opentelemetry import trace

        attrs = {"gen_ai.request.id": t.request_id, "gen_ai.response.model": self.model_name,
                 "gen_ai.usage.input_tokens": t.prompt_tokens, "gen_ai.usage.output_tokens": t.output_tokens,
                 "gen_ai.response.finish_reasons": [t.finish_reason], "tokenmill.detokenize_seconds": t.detokenize_s}
        if t.first_token is not None:
            attrs["gen_ai.latency.time_to_first_token"] = t.first_token - t.arrival
        root = self.tracer.start_span("llm_request", start_time=_ns(t.arrival), kind=trace.SpanKind.SERVER,
                                      attributes=attrs)
        context = trace.set_span_in_context(root)
        scheduled = t.scheduled if t.scheduled is not None else t.first_token
        phases = [("queue", t.arrival, scheduled), ("prefill", scheduled, t.first_token),
                  ("decode", t.first_token, t.last_token), ("detokenize", t.output_started, t.finished)]
        for name, start, end in phases:
            if start is not None and end is not None:
                self.tracer.start_span(name, context=context, start_time=_ns(start)).end(end_time=_ns(max(start, end)))
        root.end(end_time=_ns(t.finished))

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
