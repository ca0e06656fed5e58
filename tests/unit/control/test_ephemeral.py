"""Pruning ephemeral samplers: the newest N of a session stay, older ones go unless a request uses
them; named samplers and other sessions are never touched."""

from __future__ import annotations

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control.runs import Runs
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import SamplingSessionRow


def _ephemeral(runs: Runs, session: str, n: int) -> str:
    sid = f"{session}:sample:{n}"
    d = runs.artifacts.path(runs.sampling_sessions.ephemeral_key(sid))
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(b"x")
    runs.sampling_sessions.create_sampling_session(session, n, "base", None, str(d))
    return sid


def test_older_ephemeral_samplers_go_unless_in_use(tmp_path):
    runs = Runs(Store.sqlite(tmp_path / "db.sqlite"), LocalArtifactStore(tmp_path))
    s, other = runs.sessions.create_session([], {}, None), runs.sessions.create_session([], {}, None)
    # seq 1 is a named sampler (from a checkpoint path): never pruned, though it shares the counter.
    named = runs.sampling_sessions.create_sampling_session(s, 1, "base", "tinker://x/sampler_weights/a", str(tmp_path / "named"))
    ids = [_ephemeral(runs, s, n) for n in (0, 2, 3, 4, 10)]
    theirs = [_ephemeral(runs, other, n) for n in range(4)]

    deleted = runs.sampling_sessions.prune_ephemeral_samplers(s, keep=2, busy=lambda sid: sid == ids[1])
    assert deleted == [ids[0], ids[2]]  # ids[1] is used by a queued or decoding request: spared
    for sid in deleted:
        assert runs.store.get(SamplingSessionRow, sid) is None and not runs.artifacts.path(runs.sampling_sessions.ephemeral_key(sid)).exists()
    assert runs.artifacts.path(runs.sampling_sessions.ephemeral_key(ids[1])).exists() and runs.store.get(SamplingSessionRow, named.sampling_session_id)

    assert runs.sampling_sessions.prune_ephemeral_samplers(s, keep=2, busy=lambda sid: False) == [ids[1]]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "_ephemeral").iterdir()) == sorted(ids[3:] + theirs)
