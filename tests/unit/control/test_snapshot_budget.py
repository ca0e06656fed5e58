"""The snapshot budget (control/recovery.py): a run's snapshot is due `snapshot_interval_s` after its
last, and waits while the snapshots the engine reported (StepOutput.snapshot_s) have taken more than
`snapshot_budget` of the time. Driven by a fake clock: each run steps once a second and every
snapshot is reported as costing COST seconds."""

from __future__ import annotations

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control.recovery import Recovery
from tinkerd.control.store.db import Store
from tinkerd.types import AdamParams, OptimStepOp

COST = 0.3  # a rank-32 SmolLM2 snapshot on this CPU


def _simulate(tmp_path, runs: int, seconds: int, budget: float) -> dict[str, list[int]]:
    """The seconds at which each run's optim_step carried a snapshot key."""
    now = [0.0]
    recovery = Recovery(Store.sqlite(tmp_path / "db.sqlite"), LocalArtifactStore(tmp_path), rebuild=None,
                        snapshot_interval_s=10.0, snapshot_budget=budget, clock=lambda: now[0])
    taken: dict[str, list[int]] = {f"run-{k}": [] for k in range(runs)}
    for second in range(seconds):
        now[0] = float(second)
        for seq, model_id in enumerate(taken):
            op = OptimStepOp(model_id, AdamParams())
            recovery.maybe_snapshot(op, 1000 * second + seq)
            if op.snapshot_dir is not None:
                assert op.snapshot_dir == Recovery.snapshot_key(model_id, 1000 * second + seq)
                taken[model_id].append(second)
                recovery.snapshot_spent(COST)  # reported by the engine's next step
    return taken


def test_one_run_within_the_budget_snapshots_every_interval(tmp_path):
    assert _simulate(tmp_path, 1, 61, budget=0.05) == {"run-0": [0, 10, 20, 30, 40, 50, 60]}


def test_many_runs_stretch_their_intervals_to_keep_within_the_budget(tmp_path):
    seconds = 600
    taken = _simulate(tmp_path, 4, seconds, budget=0.05)
    spent = COST * sum(len(t) for t in taken.values())
    # Each run's first step snapshots at once; after that they keep within budget x time (4 runs:
    # each every 4 x 0.3 / 0.05 = 24 s), give or take the snapshot under way.
    assert spent <= 4 * COST + 0.05 * seconds + COST
    for model_id, seconds_taken in taken.items():
        assert seconds_taken[0] == 0
        gaps = [b - a for a, b in zip(seconds_taken, seconds_taken[1:])]
        # No run starves: every one keeps getting snapshots, each more than one interval apart.
        assert len(seconds_taken) >= 20 and all(gap >= 10 for gap in gaps), (model_id, seconds_taken)
        assert max(gaps) <= 40, (model_id, gaps)


def test_without_a_budget_every_due_snapshot_is_taken(tmp_path):
    taken = _simulate(tmp_path, 4, 61, budget=1.0)
    assert all(t == [0, 10, 20, 30, 40, 50, 60] for t in taken.values())
