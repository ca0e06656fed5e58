"""Control.submit under a queue budget (control/backpressure.py): new work over a target's or the
server's budget is refused with QueueFull (HTTP 429 + Retry-After) before anything is stored; a
re-send of an accepted op is answered with its future, never refused; refusals are counted; and
every accepted op still runs once the worker starts."""

from __future__ import annotations

import pytest

from tests.unit.control.test_scheduler import FakeEngine, _wait_done, train_op
from tinkerd.control.backpressure import QueueBudget
from tinkerd.control.control import Control, Work
from tinkerd.control.store.db import Store
from tinkerd.errors import QueueFull


def _submit(c: Control, target: str, seq_id: int):
    return c.submit("OptimStep", target, seq_id, b"", Work(train_op(), lambda r: (str(r).encode(), "text/plain")))


def test_over_budget_new_ops_are_refused_and_accepted_ones_all_run(tmp_path):
    engine = FakeEngine()
    engine.release_first_step.set()
    c = Control(Store.sqlite(tmp_path / "db.sqlite"), engine)
    c.budget = QueueBudget(per_target=2, total=3)  # the worker is not started: everything stays queued
    accepted = [_submit(c, "a", 0), _submit(c, "a", 1)]
    with pytest.raises(QueueFull, match="a already has 2 ops waiting") as refused:
        _submit(c, "a", 2)
    assert (refused.value.status_code, refused.value.headers) == (429, {"Retry-After": "1"})
    again = _submit(c, "a", 1)  # the client did not hear the answer and sends the op again
    assert (again.request_id, again.new) == (accepted[1].request_id, False)
    accepted.append(_submit(c, "b", 0))
    with pytest.raises(QueueFull, match="the server already has 3 ops waiting"):
        _submit(c, "c", 0)
    assert c.queue.depth() == 3
    assert c.store.future_by_dedupe_key("OptimStep|None|a|2") is None  # a refused op leaves no trace
    counted = {s.labels["scope"]: s.value for m in c.metrics.registry.collect() if m.name == "tinkerd_ops_refused"
               for s in m.samples if s.name.endswith("_total")}
    assert counted == {"target": 1, "server": 1}

    c.start()
    try:
        assert all(_wait_done(c, a.request_id).status == "complete" for a in accepted)
        assert _submit(c, "a", 2).new  # the queue drained: the refused op goes in when sent again
    finally:
        c.stop()
