"""Inflight samplers' bookkeeping (control/inflight.py): an inflight save repoints every inflight
session of its run, and only its run's; older saves' adapter directories go beyond the newest N and
only while none of the run's inflight sessions has a request in flight; snapshot pruning and fsck
leave inflight sessions alone."""

from __future__ import annotations

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control import fsck, inflight
from tinkerd.control.oplog import CreateSampler
from tinkerd.control.runs import Runs
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import SamplingSessionRow


def _save(runs: Runs, session: str, n: int, run: str | None, busy=lambda sid: False) -> tuple[str, list[str]]:
    """What bookkeeping does after one save_weights_for_sampler of `run` (None: a snapshot)."""
    sid = f"{session}:sample:{n}"
    key = runs.sampling_sessions.ephemeral_key(sid)
    runs.artifacts.put(key, {"adapter_model.safetensors": b"x"})
    if run is None:
        runs.sampling_sessions.create_sampling_session(session, n, "base", None, key, accepted=True)
        runs.sampling_sessions.prune_ephemeral_samplers(session, 2, busy)
        return sid, []
    return sid, inflight.publish(runs, CreateSampler(session, n, "base", key, inflight_of=run), 2, busy)


def _adapter(runs: Runs, sid: str) -> str:
    return runs.store.get(SamplingSessionRow, sid).adapter_dir


def test_an_inflight_save_repoints_its_runs_sessions_and_prunes_older_adapters(tmp_path):
    runs = Runs(Store.sqlite(tmp_path / "db.sqlite"), LocalArtifactStore(tmp_path))
    s = runs.sessions.create_session([], {}, None)
    a, _ = _save(runs, s, 0, "run-1")
    other, _ = _save(runs, s, 1, "run-2")
    b, deleted = _save(runs, s, 2, "run-1")
    assert _adapter(runs, a) == _adapter(runs, b) == runs.sampling_sessions.ephemeral_key(b) and deleted == []  # 2 kept
    assert _adapter(runs, other) == runs.sampling_sessions.ephemeral_key(other)  # another run's target stays

    # Snapshot samplers of the same session are pruned as before, never an inflight one.
    for n in (3, 4, 5):
        _save(runs, s, n, None)
    assert runs.store.get(SamplingSessionRow, a) is not None and runs.artifacts.path(runs.sampling_sessions.ephemeral_key(a)).is_dir()

    # A request in flight on any of the run's inflight sessions spares the old directories.
    c, deleted = _save(runs, s, 6, "run-1", busy=lambda sid: sid == a)
    assert deleted == [] and runs.artifacts.path(runs.sampling_sessions.ephemeral_key(a)).is_dir()
    d, deleted = _save(runs, s, 7, "run-1")
    assert deleted == [runs.sampling_sessions.ephemeral_key(a), runs.sampling_sessions.ephemeral_key(b)]
    assert {_adapter(runs, x) for x in (a, b, c, d)} == {runs.sampling_sessions.ephemeral_key(d)}
    assert runs.artifacts.path(runs.sampling_sessions.ephemeral_key(c)).is_dir() and runs.artifacts.path(runs.sampling_sessions.ephemeral_key(other)).is_dir()

    # fsck: the kept older directory (c's) is no orphan.
    report = fsck.Fsck(runs.store, tmp_path).check()
    assert [p for p in report.problems if p.kind == "orphan-sampler"] == []
