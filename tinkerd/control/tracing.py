"""OpenTelemetry spans per op, only when an OTLP endpoint is configured (`--otlp-endpoint`, or the
standard OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).

Off (the default) nothing here is imported and Metrics.tracer is None: the one cost is that `None`
check per finished op. On, the spans are made once the op's result is stored, from the times control
already took, so nothing is added to the op's own path: one root span per op
`tinkerd.<RequestType>` from acceptance to the stored result, with four children in order:

    accept  the request parsed and validated (Work built) until its FutureRow is committed
    queue   committed until the scheduler hands it to the engine
    engine  in the engine (one step for a training op; admission to last token for a sample)
    result  finalize, usage and the FutureRow update, until the waiting callers are woken

control keeps perf_counter times; they are mapped to the wall clock (what OTLP carries) with one
offset taken per op. The provider batches and exports on its own thread (BatchSpanProcessor).
Attributes: the request_id, op type, lane, queue target (a run id or sampling session) and outcome.
"""

from __future__ import annotations

import time
from typing import Any

from tinkerd.errors import TinkerdError


class OpTracer:
    def __init__(self, provider: Any):
        from opentelemetry import trace

        self._trace = trace
        self.provider = provider
        self.tracer = provider.get_tracer("tinkerd")

    @classmethod
    def otlp(cls, endpoint: str, service_name: str = "tinkerd") -> "OpTracer":
        """A provider exporting OTLP/HTTP protobuf to `endpoint` (e.g. http://collector:4318)."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise SystemExit(f"--otlp-endpoint needs OpenTelemetry: pip install -r requirements/otel.txt ({e})") from e
        if not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"  # the base URL form of OTEL_EXPORTER_OTLP_ENDPOINT
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider)

    def op_done(self, q: Any, lane: str, status: str, stages: list[float], result: Any) -> None:
        """`stages`: perf_counter times [accepted, queued, admitted, engine done, stored]."""
        offset = time.time_ns() - time.perf_counter_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        root = self.tracer.start_span(f"tinkerd.{q.request_type}", start_time=ns(stages[0]), attributes={
            "tinkerd.request_id": q.request_id, "tinkerd.op": q.request_type, "tinkerd.lane": lane,
            "tinkerd.target": q.target, "tinkerd.status": status})
        ctx = self._trace.set_span_in_context(root)
        for name, start, end in zip(("accept", "queue", "engine", "result"), stages, stages[1:]):
            self.tracer.start_span(name, context=ctx, start_time=ns(start)).end(end_time=ns(max(end, start)))
        if isinstance(result, TinkerdError):
            from opentelemetry.trace import Status, StatusCode

            root.set_status(Status(StatusCode.ERROR, result.message))
            root.set_attribute("tinkerd.error_category", result.category)
        root.end(end_time=ns(stages[-1]))

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what the batch processor holds
