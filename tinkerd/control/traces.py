"""A session's trace (`RestClient.export_session_trace`, `tinker session export-trace`): every op of
its training runs and sampling sessions on a timeline, from what the futures and usage tables hold.

The file is the Trace Event Format's JSON ("traceEvents"), which ui.perfetto.dev opens as it opens a
.pftrace (it reads the file's content, not its name). One track per training run or sampling
session, named after it; per op one slice from accepted to stored, named after the op
(ForwardBackward, OptimStep, Sample, ...), with two slices inside it: `queued` (accepted until the
engine got it, the usage row's queue wait) and `engine` (the op's compute time, ending when its
result was stored). Args: request_id, seq_id, status, error, the request and result sizes in bytes,
and the tokens it was billed for. Ops still pending have a slice up to the export. Timestamps are
microseconds since the Unix epoch (UTC).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.futures import FutureRepository
from tinkerd.control.store.runs import RunRepository
from tinkerd.control.store.sampling import SamplingSessionRepository

_EPOCH = datetime(1970, 1, 1)
# Ops per trace: a long session's ops beyond this are left out (the newest are kept), and the trace
# says so in its metadata.
MAX_OPS = 200_000
_US = timedelta(microseconds=1)


def _us(at: datetime) -> int:
    return (at - _EPOCH) // _US


def session_trace(store: Store, session_id: str) -> dict:
    runs = RunRepository(store).ids_of_session(session_id)
    samplers = SamplingSessionRepository(store).ids_of_session(session_id)
    targets = list(runs) + list(samplers)
    tracks = {t: i + 1 for i, t in enumerate(targets)}
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": f"session {session_id}"}}]
    for target, tid in tracks.items():
        kind = "training run" if tid <= len(runs) else "sampling session"
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": f"{kind} {target}"}})
    if not targets:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    rows = FutureRepository(store).traced(targets, MAX_OPS + 1)
    now = utcnow()
    for op in reversed(rows[:MAX_OPS]):
        (rid, kind, target, seq_id, status, error, created, completed, compute_s, body_n, result_n,
         queue_wait_s, prefill, sampled, trained, forward) = dataclasses.astuple(op)
        start, end = _us(created), _us(completed or now)
        tid = tracks[target]
        tokens = {k: v for k, v in (("prefill_tokens", prefill), ("sampled_tokens", sampled),
                                    ("trained_tokens", trained), ("forward_tokens", forward)) if v}
        events.append({"ph": "X", "name": kind, "pid": 1, "tid": tid, "ts": start, "dur": max(end - start, 0),
                       "args": {"request_id": rid, "seq_id": seq_id, "status": status, "error": error,
                                "request_bytes": body_n, "result_bytes": result_n, **tokens}})
        if queue_wait_s:
            wait = min(round(queue_wait_s * 1e6), end - start)
            events.append({"ph": "X", "name": "queued", "pid": 1, "tid": tid, "ts": start, "dur": wait})
        if compute_s and completed is not None:
            busy = min(round(compute_s * 1e6), end - start)
            events.append({"ph": "X", "name": "engine", "pid": 1, "tid": tid, "ts": end - busy, "dur": busy})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if len(rows) > MAX_OPS:
        trace["metadata"] = {"truncated": f"only the newest {MAX_OPS} ops are in this trace"}
    return trace
