"""OpenTelemetry spans per op (control/tracing.py), with the SDK's in-memory exporter and a fake
engine: one root span per op with accept -> queue -> engine -> result children that tile it in
order, the op's attributes, an error status for a failed op; none of it unless a tracer is set."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tests.unit.control.test_scheduler import FakeEngine, _wait_done, sample_op, train_op
from tinkerd.control.control import Control, Work
from tinkerd.control.store.db import Store
from tinkerd.control.tracing import OpTracer
from tinkerd.types import SampleOp, SamplingParams


@pytest.fixture
def traced(tmp_path):
    engine = FakeEngine()
    engine.release_first_step.set()
    control = Control(Store.sqlite(tmp_path / "db.sqlite"), engine)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    control.metrics.tracer = OpTracer(provider)
    control.start()
    yield control, exporter
    control.stop()


def _finalize(result):
    return str(result).encode(), "text/plain"


def test_each_op_is_a_root_span_tiled_by_its_four_stages(traced):
    control, exporter = traced
    trained = control.submit("OptimStep", "model-1", 0, b"", Work(train_op(), _finalize))
    sampled = control.submit("Sample", "session-1", 0, b"", Work(sample_op(max_tokens=4), _finalize))
    for a in (trained, sampled):
        assert _wait_done(control, a.request_id).status == "complete"
    spans = _exported(exporter, 2)
    roots = {s.attributes["tinkerd.request_id"]: s for s in spans if s.parent is None}
    assert set(roots) == {trained.request_id, sampled.request_id}
    for request_id, op_type, lane, target in ((trained.request_id, "OptimStep", "train", "model-1"),
                                              (sampled.request_id, "Sample", "sample", "session-1")):
        root = roots[request_id]
        assert root.name == f"tinkerd.{op_type}"
        assert dict(root.attributes) == {"tinkerd.request_id": request_id, "tinkerd.op": op_type, "tinkerd.lane": lane,
                                         "tinkerd.target": target, "tinkerd.status": "complete"}
        children = sorted((s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
                          key=lambda s: s.start_time)
        assert [c.name for c in children] == ["accept", "queue", "engine", "result"]
        assert all(c.context.trace_id == root.context.trace_id for c in children)
        assert children[0].start_time == root.start_time and children[-1].end_time == root.end_time
        for a, b in zip(children, children[1:]):
            assert a.end_time == b.start_time  # contiguous: the stages account for the whole op
        assert all(c.end_time >= c.start_time for c in children)


def _exported(exporter, roots: int) -> list:
    """The finished spans once `roots` ops have theirs: the row is stored just before its spans end
    (results.py: on_stored), so a test that saw the row waits for them (bounded, not a timing check)."""
    for _ in range(1000):
        spans = exporter.get_finished_spans()
        if sum(s.parent is None for s in spans) >= roots:
            return list(spans)
        threading.Event().wait(0.01)
    raise AssertionError("the ops' spans were never exported")


def test_a_failed_op_has_an_error_status(traced):
    control, exporter = traced
    bad = control.submit("Sample", "session-2", 0, b"",
                         Work(SampleOp("m", None, np.array([]), SamplingParams(max_tokens=2)), _finalize))
    assert _wait_done(control, bad.request_id).status == "failed"
    root = next(s for s in _exported(exporter, 1) if s.parent is None)
    assert root.status.status_code == StatusCode.ERROR and "empty" in root.status.description
    assert root.attributes["tinkerd.status"] == "failed" and root.attributes["tinkerd.error_category"] == "user"


def test_no_tracer_by_default(tmp_path):
    control = Control(Store.sqlite(tmp_path / "db.sqlite"), FakeEngine())
    assert control.metrics.tracer is None
