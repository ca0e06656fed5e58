"""control/metrics.py counted from Control's own calls, with fake engines: engine crashes as
recoveries and restart attempts, failed ops by outcome, and tokens from the Meter."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.unit.control.test_poison import POISON, DyingEngine, sample
from tests.unit.control.test_scheduler import _wait_done
from tinkerd.control.control import Control
from tinkerd.control.metering import Billing, Usage
from tinkerd.control.store.db import Store


def _samples(control: Control) -> dict:
    text = control.metrics.exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_engine_deaths_count_as_recoveries_and_the_poison_op_as_failed(tmp_path):
    engine = DyingEngine(self_inflicted=True)
    control = Control(Store.sqlite(tmp_path / "db.sqlite"), engine)
    ok = sample("m", 2)
    ok.billing = Billing("acct", None, "m", lambda res: Usage(prefill_tokens=2, sampled_tokens=5))
    ids = [control.submit("Sample", "s-ok", 0, b"", ok).request_id,
           control.submit("Sample", "s-p", 0, b"", sample(POISON)).request_id]
    control.start()
    try:
        rows = [_wait_done(control, rid) for rid in ids]
        assert [r.status for r in rows] == ["complete", "failed"]
        m = _samples(control)
    finally:
        control.stop()
    # Every death the engine saw (with the other op in flight, then alone): one restart that came back.
    assert len(engine.deaths) >= 2
    assert m[("tinkerd_engine_recoveries_total", (("outcome", "recovered"),))] == len(engine.deaths)
    assert m[("tinkerd_engine_restarts_total", ())] == len(engine.deaths)
    assert m[("tinkerd_ops_accepted_total", (("lane", "sample"), ("type", "Sample")))] == 2
    assert m[("tinkerd_ops_completed_total", (("status", "complete"), ("type", "Sample")))] == 1
    assert m[("tinkerd_ops_completed_total", (("status", "failed"), ("type", "Sample")))] == 1
    assert m[("tinkerd_tokens_total", (("kind", "prefill"),))] == 2
    assert m[("tinkerd_tokens_total", (("kind", "sampled"),))] == 5
    assert m[("tinkerd_engine_state", (("state", "running"),))] == 1
