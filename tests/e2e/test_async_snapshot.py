"""The engine SIGKILLed while a background recovery snapshot is being written (engine/snapshots.py),
after the optim_step it belongs to was acknowledged: the run goes on with exactly the losses and
final weights of an uninterrupted run.

This is the case a synchronous snapshot never had: an op reported complete whose snapshot is not
on disk. The write is held in flight by strace delaying every fsync of the engine process by
FSYNC_DELAY_S (ptrace, no hook in the server), so the test sees, in this order: the optim_step's
result back at the SDK, the snapshot's temp dir there and its real name not, then the kill.
Recovery must start from the snapshot before and replay the logged forward_backward and
optim_step after it.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import tinker
import torch
from tinker import types

from tests.chaos import TINY, engine_pid, recoveries
from tests.e2e.test_faults import DATA, _attach_strace, _data_dir, _wait_gone
from tests.serverproc import API_KEY, start_server
from tinkerd.engine.checkpoints import read_adapter

# Every optim_step snapshots, so the one before the killed write is the previous step's.
ARGS = ["--threads", "1", "--snapshot-interval-s", "0", "--snapshot-budget", "1"]
KILLED_AT = 3  # the step whose snapshot write is killed
FSYNC_DELAY_S = 20


def _train(data_dir, url: str, before_step=None) -> tuple[list[float], str, str]:
    tc = tinker.ServiceClient(base_url=url, api_key=API_KEY).create_lora_training_client(
        base_model=TINY, rank=8, seed=11).result()
    losses = []
    for i, datums in enumerate(DATA):
        if before_step is not None:
            before_step(i, tc)
        fb = tc.forward_backward(datums, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    path = tc.save_state("final").result().path
    run, seg, name = path[len("tinker://"):].split("/")
    return losses, str(data_dir / "checkpoints" / run / seg / name), tc.model_id


def _stop(tracer) -> None:
    """strace sleeps out an injected delay before it handles a detach; its tracee is dead by now."""
    if tracer.poll() is None:
        tracer.kill()
        tracer.wait(timeout=30)


@pytest.mark.slow
def test_engine_killed_inside_a_background_snapshot_write_recovers_exactly(tmp_path, models_dir):
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (.ci/run installs it)")
    (tmp_path / "ref").mkdir()
    ref_data = _data_dir(tmp_path / "ref", models_dir)
    srv = start_server(ref_data, [TINY], ARGS)
    try:
        ref_losses, ref_final, _ = _train(ref_data, srv.url)
    finally:
        srv.stop()

    (tmp_path / "run").mkdir()
    data = _data_dir(tmp_path / "run", models_dir)
    srv = start_server(data, [TINY], ARGS)
    seen: dict = {}

    def kill_inside_snapshot(i: int, tc) -> None:
        snaps = data / "snapshots" / tc.model_id
        if i == KILLED_AT:  # this step's optim_step writes its snapshot with every fsync held
            while not (snaps / f"seq-{2 * KILLED_AT:012d}").is_dir():  # the step before's is written unheld
                time.sleep(0.01)
            seen["tracer"] = _attach_strace(engine_pid(srv.proc.pid), [
                "-e", "trace=fsync", "-e", f"inject=fsync:delay_enter={FSYNC_DELAY_S * 1_000_000}", "-o", os.devnull])
        elif i == KILLED_AT + 1:  # the step before it was acknowledged; its snapshot is still being written
            deadline = time.monotonic() + FSYNC_DELAY_S / 2
            while not list(snaps.glob(".seq-*.tmp-*")) and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["temp"] = [p.name for p in snaps.glob(".seq-*.tmp-*")]
            seen["whole"] = sorted(p.name for p in snaps.iterdir() if p.name.startswith("seq-"))
            pid = engine_pid(srv.proc.pid)
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)
            _stop(seen["tracer"])

    try:
        losses, final, _ = _train(data, srv.url, kill_inside_snapshot)
        assert len(recoveries(srv.lines)) == 1
    finally:
        if "tracer" in seen:
            _stop(seen["tracer"])
        srv.stop()
    # Killed inside the write: the step's snapshot was a temp dir, and the newest whole one was the
    # step before's (create's is seq 0; step i's optim_step is seq 2 + 2 i).
    assert len(seen["temp"]) == 1 and seen["temp"][0].startswith(f".seq-{2 + 2 * KILLED_AT:012d}.tmp-"), seen
    assert seen["whole"][-1] == f"seq-{2 * KILLED_AT:012d}", seen
    assert losses == ref_losses  # bit-identical: nothing acknowledged was lost or run twice
    a, b = read_adapter(final), read_adapter(ref_final)
    assert a.step == b.step == len(DATA)
    for name, (a_a, a_b) in a.weights.items():
        assert torch.equal(a_a, b.weights[name][0]) and torch.equal(a_b, b.weights[name][1]), name
    for i, s in a.optimizer_state["state"].items():
        for k, v in s.items():
            assert torch.equal(v, b.optimizer_state["state"][i][k]), (i, k)
