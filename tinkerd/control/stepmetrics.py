"""Per-step training metrics: what each forward_backward, forward and optim_step returned, stored as
it completes, for the console's live loss and metric curves (api/console).

A ResultStore recorder (control/results.py): it runs on the control worker after the op's
bookkeeping and before its future completes, so a client that has a step's result finds the step's
point stored. Writing it is safe to redo (one row per request_id; a re-run keeps the first), as a
recorder must be. Only finite floats are kept: JSON has no NaN, and a curve cannot draw one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.futures import FutureRepository
from tinkerd.control.store.runs import StepMetricRepository
from tinkerd.control.store.tables import StepMetricRow
from tinkerd.types import ForwardBackwardOp, ForwardBackwardResult, OptimStepOp

# A curve holds at most this many points per metric on a page (the newest); a run of 100k steps
# would otherwise send ~3 MB of points every refresh. 2,000 is more than a phone or a laptop screen
# has pixels across, so nothing visible is lost.
MAX_POINTS = 2000


@dataclass
class Point:
    seq_id: int
    request_type: str
    metrics: dict[str, float]


class StepMetrics:
    def __init__(self, store: Store):
        self.steps = StepMetricRepository(store)
        self.futures = FutureRepository(store)

    def record(self, request_id: str, op: Any, result: Any) -> None:
        if isinstance(op, ForwardBackwardOp) and isinstance(result, ForwardBackwardResult):
            metrics, model_id = result.metrics, op.model_id
        elif isinstance(op, OptimStepOp) and isinstance(result, dict):
            metrics, model_id = result, op.model_id
        else:
            return
        kept = {str(k): float(v) for k, v in metrics.items()
                if isinstance(v, (int, float)) and math.isfinite(float(v))}
        future = self.futures.seq_and_type(request_id) if kept else None
        if future is None:  # nothing to draw (optim_step returns no metrics today), or an internal op
            return
        seq_id, request_type = future
        self.steps.add(StepMetricRow(request_id=request_id, model_id=model_id, seq_id=seq_id,
                                     request_type=request_type, metrics=kept, recorded_at=utcnow()))

    def points(self, model_id: str, after_seq: int = -1, limit: int = MAX_POINTS) -> list[Point]:
        """The run's steps after `after_seq`, oldest first: the newest `limit` of them."""
        rows = self.steps.newest(model_id, after_seq, limit)
        return [Point(r.seq_id, r.request_type, dict(r.metrics or {})) for r in reversed(rows)]


def series(points: list[Point]) -> dict[str, list[tuple[int, float]]]:
    """metric name -> [(seq_id, value)]: forward_backward's metrics under their own names, a forward
    pass's (an evaluation) under `eval <name>`, optim_step's as they are."""
    out: dict[str, list[tuple[int, float]]] = {}
    for p in points:
        prefix = "eval " if p.request_type == "Forward" else ""
        for name, value in p.metrics.items():
            out.setdefault(prefix + name, []).append((p.seq_id, value))
    return out
