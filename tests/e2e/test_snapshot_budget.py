"""--snapshot-budget through the SDK: the engine reports what its recovery snapshots take
(StepOutput.snapshot_s) and control spaces them out to keep within the budget (control/recovery.py).

With --snapshot-interval-s 0 every optim_step would snapshot, and the run's directory would hold
the last two (engine/snapshots.py: KEEP). With a budget of 0.1% of the engine's time, a snapshot of
the tiny model (tens of ms) spaces the next one a minute or so out: only the first step's is taken."""

from __future__ import annotations

import time

import tinker
from tinker import types

from tests.chaos import TINY
from tests.e2e.test_faults import DATA
from tests.serverproc import API_KEY, start_server


def _snapshots(data_dir, model_id: str) -> list[str]:
    """The run's whole snapshots (not a write's temp dir), once no write is in flight."""
    run_dir = data_dir / "snapshots" / model_id
    for _ in range(100):
        names = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
        if names and all(n.startswith("seq-") for n in names):
            return names
        time.sleep(0.1)
    return names


def test_snapshots_beyond_the_budget_wait_and_training_goes_on(tmp_path):
    data_dir = tmp_path / "data"
    server = start_server(data_dir, [TINY], ["--threads", "1", "--snapshot-interval-s", "0", "--snapshot-budget", "0.001"])
    try:
        tc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY).create_lora_training_client(
            base_model=TINY, rank=8, seed=5).result()
        for datums in DATA[:3]:
            tc.forward_backward(datums, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert _snapshots(data_dir, tc.model_id) == ["seq-000000000002"]  # the first optim_step's only
    finally:
        server.stop()
