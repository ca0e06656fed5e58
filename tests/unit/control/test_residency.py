"""Which runs the engine lets go: those of ended sessions at once (whatever the expiry, 0 included),
those of sessions silent past the expiry; never one with an op queued or running."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tinkerd.control.residency import Residency
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import SessionRow, TrainingRunRow, UnloadedRunRow


@pytest.fixture
def store(tmp_path):
    s = Store.sqlite(tmp_path / "db.sqlite")
    now, old = utcnow(), utcnow() - timedelta(seconds=600)
    for session, heartbeat, finished in (("open", now, None), ("quiet", old, None), ("ended", now, "success"),
                                          ("ended-busy", now, "success"), ("ended-gone", now, "success")):
        s.add(SessionRow(session_id=session, account_id="a", created_at=old, last_heartbeat_at=heartbeat,
                         finished_reason=finished))
        s.add(TrainingRunRow(model_id=f"{session}:train:0", session_id=session, base_model="tiny", lora_rank=4,
                             lora_config={"rank": 4}, created_at=old, last_request_at=heartbeat))
    s.add(UnloadedRunRow(model_id="ended-gone:train:0", unloaded_at=now))  # released already
    return s


def busy(model_id: str) -> bool:
    return model_id == "ended-busy:train:0"


def test_ended_and_silent_sessions_runs_are_idle(store):
    assert Residency(store, None, expiry_s=300).idle_runs(busy) == ["ended:train:0", "quiet:train:0"]


def test_with_expiry_off_only_ended_sessions_runs_go(store):
    residency = Residency(store, None, expiry_s=0)
    assert residency.idle_runs(busy) == ["ended:train:0"]
    # At start-up nothing is in flight yet: every ended session's run is released.
    assert residency.release_idle_at_start() == {"ended:train:0", "ended-busy:train:0", "ended-gone:train:0"}
