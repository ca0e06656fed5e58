"""A real `tinkerd serve` with the standard OTEL_EXPORTER_OTLP_ENDPOINT set exports OTLP/HTTP spans
per SDK op (accept -> queue -> engine -> result) to a collector, here a local HTTP endpoint that
decodes the OTLP protobuf requests; without the setting a server exports nothing."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import tinker
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY, start_server


@pytest.fixture
def collector():
    spans: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.path == "/v1/traces":
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                spans.extend(s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", spans
    httpd.shutdown()


def test_sdk_ops_are_exported_as_spans(tmp_path, collector):
    url, spans = collector
    srv = start_server(tmp_path, [TINY], ["--threads", "1"],
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        sc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
        fb = tc.forward_backward([datum], "cross_entropy")
        fb.result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        for _ in range(100):  # the batch processor exports every 100 ms here; bounded wait, no timing assert
            if sum(s.name == "tinkerd.OptimStep" for s in spans):
                break
            time.sleep(0.1)
    finally:
        srv.stop()
    roots = {s.name: s for s in spans if not s.parent_span_id}
    assert {"tinkerd.CreateModel", "tinkerd.ForwardBackward", "tinkerd.OptimStep"} <= set(roots)
    root = roots["tinkerd.ForwardBackward"]
    attrs = {a.key: a.value.string_value for a in root.attributes}
    assert attrs["tinkerd.target"] == tc.model_id and attrs["tinkerd.status"] == "complete"
    children = sorted((s for s in spans if s.parent_span_id == root.span_id), key=lambda s: s.start_time_unix_nano)
    assert [c.name for c in children] == ["accept", "queue", "engine", "result"]
    assert children[0].start_time_unix_nano == root.start_time_unix_nano
    assert children[-1].end_time_unix_nano == root.end_time_unix_nano
    # Wall-clock times (OTLP's), not perf_counter: within the test's own span of time.
    assert abs(root.start_time_unix_nano / 1e9 - time.time()) < 600
