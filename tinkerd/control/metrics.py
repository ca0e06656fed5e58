"""Prometheus metrics of the control plane (GET /metrics, api/routes/service.py).

Two kinds, so that an unscraped server pays almost nothing:
- events, counted where control already knows them, one call each: an op accepted (`accepted`,
  from Control.submit), an op finished and stored (`completed`, ResultStore.on_stored: its latency
  from acceptance, its queue wait, its engine time, and a sample's prompt tokens served from the
  prefix cache), metered tokens (`on_usage`, a Meter
  listener), an engine recovery (`engine_recovery`), and every SQL statement's duration (SQLAlchemy
  cursor events on the store's engine). Each is a lock and an add, about a microsecond.
- state, read only when scraped (`_StateCollector`): queue depth and oldest wait by lane, ops in
  flight, the engine's state, resident adapters, KV-cache use, result-store stalls.

Labels are op types, lanes and token kinds, never accounts, runs or paths: the series stay few, and
the page tells nothing about any one account (which is why /metrics is served without a key).

Each Control has its own registry (tests run several servers' controls in one process).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tinkerd.control.metering import Usage
from tinkerd.control.scheduler import Scheduler
from tinkerd.errors import TinkerdError

if TYPE_CHECKING:
    from tinkerd.control.control import Control
    from tinkerd.control.queue import QueuedOp
    from tinkerd.control.store.db import Store

# Ops take from ~1 ms (a cached get) to many minutes (a long sample, a big save).
_OP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# A WAL commit is well under a millisecond on local disk; a busy-timeout wait is seconds.
_DB_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ops_accepted = Counter("tinkerd_ops_accepted", "Ops accepted (stored and queued)", ["type", "lane"],
                                    registry=r)
        self.ops_completed = Counter("tinkerd_ops_completed", "Ops finished and stored, by outcome",
                                     ["type", "status"], registry=r)
        self.op_latency = Histogram("tinkerd_op_latency_seconds", "From acceptance to the result stored",
                                    ["type"], buckets=_OP_BUCKETS, registry=r)
        self.queue_wait = Histogram("tinkerd_op_queue_wait_seconds", "From acceptance to the engine taking the op",
                                    ["lane"], buckets=_OP_BUCKETS, registry=r)
        self.engine_time = Histogram("tinkerd_op_engine_seconds", "Wall time in the engine (admission to last token "
                                     "for a sample)", ["type"], buckets=_OP_BUCKETS, registry=r)
        self.tokens = Counter("tinkerd_tokens", "Metered tokens by kind", ["kind"], registry=r)
        self.prompt_cache_hits = Counter("tinkerd_prompt_cache_hit_tokens", "Prompt tokens of sample requests taken "
                                         "from a kept prefill (engine/sampler/prefix.py) instead of prefilled",
                                         registry=r)
        self.checkpoints = Counter("tinkerd_checkpoints_written", "Metered checkpoints written", registry=r)
        self.engine_restarts = Counter("tinkerd_engine_restarts", "Engine process starts after a crash (attempts)",
                                       registry=r)
        self.engine_recoveries = Counter("tinkerd_engine_recoveries", "Engine crashes handled, by outcome",
                                         ["outcome"], registry=r)
        self.ops_refused = Counter("tinkerd_ops_refused", "New ops answered 429 because a queue was over its budget "
                                   "(control/backpressure.py), by which budget", ["scope"], registry=r)
        self.shared_pass_runs = Histogram("tinkerd_shared_pass_runs", "Runs whose forward_backward ops shared one "
                                          "pass over the base model (engine/cotrain.py), per such pass",
                                          buckets=(2, 3, 4, 6, 8, 16, 32, 64), registry=r)
        self.db_latency = Histogram("tinkerd_db_statement_seconds", "SQL statement duration", ["statement"],
                                    buckets=_DB_BUCKETS, registry=r)
        # OpenTelemetry spans per op (control/tracing.py); None (the default) costs nothing.
        self.tracer: Any = None
        # False (--no-metrics): the event calls return at once and no statement is timed.
        self.enabled = True
        self._listeners: list = []
        # request_id -> perf_counter when its FutureRow was committed (the end of the "accept" span);
        # kept only while tracing.
        self._queued_at: dict[str, float] = {}

    def bind(self, control: "Control") -> None:
        """Read control's state at scrape time, and time its store's statements."""
        self.registry.register(_StateCollector(control))
        self.watch_store(control.store)

    def watch_store(self, store: "Store") -> None:
        def observe(kind: str, seconds: float) -> None:
            self.db_latency.labels(kind if kind in _STATEMENTS else "other").observe(seconds)

        self._listeners.append(store.time_statements(observe))

    def disable(self) -> None:
        """Count nothing from now on (--no-metrics; benchmarks/metrics_overhead.py compares)."""
        self.enabled = False
        for stop in self._listeners:
            stop()
        self._listeners.clear()

    # -- events (called from control) -------------------------------------------------------------

    def accepted(self, request_type: str, lane: str, request_id: str | None = None) -> None:
        """The op's FutureRow is committed and it is queued (Control.submit)."""
        if self.tracer is not None and request_id is not None:
            self._queued_at[request_id] = time.perf_counter()
        if not self.enabled:
            return
        self.ops_accepted.labels(request_type, lane).inc()

    def refused(self, scope: str) -> None:
        """A new op was answered 429: its target's or the server's queue was over its budget."""
        if self.enabled:
            self.ops_refused.labels(scope).inc()

    def completed(self, q: "QueuedOp", result: Any, compute_s: float, queue_wait_s: float,
                  engine_done: float) -> None:
        """The op's outcome is stored (ResultStore.on_stored, before its callers wake). `engine_done`:
        perf_counter when the engine gave it back."""
        if not self.enabled and self.tracer is None:
            return
        now = time.perf_counter()
        lane = Scheduler.lane_of(q.op.op)
        status = "failed" if isinstance(result, TinkerdError) else "complete"
        # The server's own ops (residency's releases and rebuilds) carry their op class name as type.
        accepted_at = q.op.accepted_at
        if self.enabled:
            self.ops_completed.labels(q.request_type, status).inc()
            self.op_latency.labels(q.request_type).observe(now - accepted_at)
            self.queue_wait.labels(lane).observe(max(queue_wait_s, 0.0))
            self.engine_time.labels(q.request_type).observe(compute_s)
            if cached := getattr(result, "prompt_cache_hit_tokens", 0):
                self.prompt_cache_hits.inc(cached)
        if self.tracer is not None:
            queued_at = self._queued_at.pop(q.request_id, accepted_at)  # re-queued after a restart: none
            admitted = max(accepted_at + queue_wait_s, queued_at)
            self.tracer.op_done(q, lane, status, [accepted_at, queued_at, admitted, engine_done, now], result)

    def on_usage(self, request_id: str, account_id: str | None, usage: Usage) -> None:
        if not self.enabled:
            return
        for kind in ("prefill", "sampled", "trained", "forward"):
            n = getattr(usage, f"{kind}_tokens")
            if n:
                self.tokens.labels(kind).inc(n)
        if usage.checkpoints:
            self.checkpoints.inc(usage.checkpoints)

    def shared_passes(self, sizes: list[int]) -> None:
        if self.enabled:
            for n in sizes:
                self.shared_pass_runs.observe(n)

    def engine_recovery(self, outcome: str, attempts: int) -> None:
        """outcome: "recovered" or "down" (the restarts gave up)."""
        if not self.enabled:
            return
        self.engine_restarts.inc(attempts)
        self.engine_recoveries.labels(outcome).inc()

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.shutdown()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


_STATEMENTS = {"select", "insert", "update", "delete"}


class _StateCollector:
    """Gauges computed from control's own state when /metrics is scraped."""

    def __init__(self, control: "Control"):
        self.control = control

    def collect(self):
        c = self.control
        now = time.perf_counter()
        depth = GaugeMetricFamily("tinkerd_queue_depth", "Ops waiting in the queue", labels=["lane"])
        oldest = GaugeMetricFamily("tinkerd_queue_oldest_wait_seconds", "Age of the longest-waiting queued op",
                                   labels=["lane"])
        for lane, ops in sorted(c.queue.lanes().items()):
            depth.add_metric([lane], len(ops))
            times = [q.op.accepted_at for q in ops if hasattr(q.op, "accepted_at")]
            oldest.add_metric([lane], now - min(times) if times else 0.0)
        yield depth
        yield oldest
        yield GaugeMetricFamily("tinkerd_ops_in_flight", "Ops handed to the engine and not finished",
                                value=len(c._inflight))
        state = GaugeMetricFamily("tinkerd_engine_state", "1 for the engine's current state", labels=["state"])
        for s in ("running", "restarting", "down"):
            state.add_metric([s], 1.0 if c.engine_state == s else 0.0)
        yield state
        resident = c.residency.resident if c.residency is not None else None
        adapters = GaugeMetricFamily("tinkerd_resident_adapters", "Adapters loaded in the engine", labels=["kind"])
        if resident is not None:
            adapters.add_metric(["training"], resident.training)
            adapters.add_metric(["sampler"], len(resident.sampler_paths))
        yield adapters
        if resident is not None:
            yield GaugeMetricFamily("tinkerd_kv_cache_bytes", "Sampler KV cache allocated (all base models)",
                                    value=resident.kv_cache_bytes)
            yield GaugeMetricFamily("tinkerd_kv_cache_budget_bytes", "Sampler KV cache budget (all base models)",
                                    value=resident.kv_cache_budget_bytes)
            # Counted by the engine since it started: a restarted engine starts again from 0.
            yield CounterMetricFamily("tinkerd_recomputed_layers", "Decoder layers whose activations training "
                                      "passes recomputed in the backward, memory being short "
                                      "(--activation-memory-gb)", value=resident.recomputed_layers)
        yield CounterMetricFamily("tinkerd_result_store_stalls", "Times storing a finished op's result had to wait "
                                  "on storage", value=c.results.stalls)
