"""Inflight samplers: `save_weights_and_get_sampling_client(kind="inflight")` (SDK 0.38).

Every inflight sampling session of a training run follows the run's one shared target: the adapter
of its latest inflight save. The save writes its adapter to a fresh directory (like a snapshot
sampler's, `checkpoints/_ephemeral/<sampler id>`); when it has succeeded, control creates the new
session and repoints every earlier inflight session of the run at that directory, in one write.
A sample request takes its session's adapter when it is accepted (it is the `adapter_path` of its
logged `SampleOp`), so a request accepted after a save completed samples those weights or newer,
and one accepted before keeps the weights it was accepted with, also across a restart's replay.

Runs on the control worker (control/bookkeeping.py), where whether a session has a queued or
decoding request is exact. docs/compatibility.md states the contract.
"""

from __future__ import annotations

from typing import Callable

from tinkerd.artifacts import adapter_key
from tinkerd.control.oplog import CreateSampler
from tinkerd.control.runs import Runs
from tinkerd.control.store.sampling import SamplingSession, SamplingSessionRepository


def _seq(sampling_session_id: str) -> int:
    return int(sampling_session_id.rsplit(":", 1)[-1])


def publish(runs: Runs, effect: CreateSampler, keep: int, busy: Callable[[str], bool]) -> list[str]:
    """Create the inflight session of `effect`, make its adapter the run's inflight target, and
    delete the adapter artifacts of the run's older inflight saves; returns the deleted keys.

    The newest `keep` saves' directories stay, so a request accepted just before a repoint (its
    row read on the API thread, not queued yet) still finds its files; older ones go only while
    none of the run's inflight sessions has a request queued or decoding (else at a later save).
    """
    runs.sampling_sessions.create_sampling_session(effect.session_id, effect.sampling_session_seq_id, effect.base_model, None,
                                 effect.adapter_dir, accepted=True, inflight_of=effect.inflight_of)
    samplers = SamplingSessionRepository(runs.store)
    samplers.repoint_inflight(effect.inflight_of, effect.adapter_dir)
    rows = samplers.inflight_of(effect.inflight_of)
    if any(busy(r.sampling_session_id) for r in rows):
        return []
    rows.sort(key=lambda r: _seq(r.sampling_session_id))
    target = adapter_key(effect.adapter_dir)
    deleted = []
    for row in rows[: max(0, len(rows) - keep)]:
        key = runs.sampling_sessions.ephemeral_key(row.sampling_session_id)  # where that session's own save wrote
        if key != target and runs.artifacts.exists(key):
            runs.artifacts.delete(key)
            deleted.append(key)
    return deleted


def kept_dirs(rows: list[SamplingSession]) -> set[str]:
    """Names under checkpoints/_ephemeral that inflight sessions own (for fsck): each inflight
    session's own save directory, which publish deletes once it is no longer among the kept."""
    return {r.sampling_session_id for r in rows if r.inflight_of is not None}
