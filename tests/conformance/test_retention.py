"""Finished futures are not kept forever (control/retention.py): through the unmodified SDK against a
live server whose results expire 1 s after retrieval and whose tombstones go 2 s after that, the
futures table stays bounded by what recovery needs, an expired future fails the SDK's poll at once
with a message naming the expiry, and a restart after the sweep still rebuilds a run exactly."""

from __future__ import annotations

import os
import random
import signal
import socket
import time

import pytest
import tinker
from tinker import types
from tinker.lib.api_future_impl import _APIFuture

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY, logged_ops, start_server

GRACE_S, TOMBSTONE_S = 1, 2
RETENTION = ["--threads", "1", "--future-retrieved-grace-s", str(GRACE_S), "--future-max-age-s", "60",
             "--future-tombstone-s", str(TOMBSTONE_S)]
ADAM = types.AdamParams(learning_rate=1e-2)


def _batch(step: int) -> list[types.Datum]:
    rng = random.Random(step)
    return [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})
            for toks in ([rng.randrange(1, 5000) for _ in range(rng.randrange(8, 24))] for _ in range(2))]


def _train(tc, steps: range) -> list[float]:
    losses = []
    for step in steps:
        fb = tc.forward_backward(_batch(step), "cross_entropy")
        tc.optim_step(ADAM).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def _rows(data_dir, model_id: str) -> list[tuple]:
    return [(r.seq_id, r.request_type, r.request_id, r.expired_at) for r in logged_ops(data_dir, model_id)]


def _latest_snapshot(data_dir, model_id: str) -> int:
    return max(int(p.name[4:]) for p in (data_dir / "snapshots" / model_id).iterdir() if p.name.startswith("seq-"))


def _wait(cond, timeout_s: float = 180.0):  # generous: 2 shared cores
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A snapshot after every optim_step: recovery then needs only the run's last optim_step.
    srv = start_server(tmp_path_factory.mktemp("tinkerd-retention"), [TINY],
                       RETENTION + ["--snapshot-interval-s", "0", "--snapshot-budget", "1"])
    yield srv
    srv.stop()


def test_the_futures_table_keeps_only_what_recovery_needs_and_an_expired_future_fails_clearly(server):
    tc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY).create_lora_training_client(
        base_model=TINY, rank=8, seed=3).result()
    steps = 12
    _train(tc, range(steps))
    accepted = 1 + 2 * steps  # create + forward_backward and optim_step per step

    def settled():
        rows = _rows(server.data_dir, tc.model_id)
        return rows if all(r[3] is not None for r in rows) and len(rows) <= 2 else None

    rows = _wait(settled)
    # The creating op (quotas count the run by it) and the op of the snapshot recovery starts from.
    assert [(r[0], r[1]) for r in rows] == [(0, "CreateModel"), (_latest_snapshot(server.data_dir, tc.model_id),
                                                                 "OptimStep")]
    assert len(rows) < accepted
    _train(tc, range(steps, 2 * steps))  # twice the ops, the same rows
    rows = _wait(settled)
    assert [r[0] for r in rows] == [0, 2 * steps * 2]

    # The last optim_step's result expired (its row stays for recovery): the SDK's poll fails at once.
    expired = _APIFuture(types.OptimStepResponse, tc.holder, types.UntypedAPIFuture(request_id=rows[1][2]),
                         time.time(), "OptimStep")
    with pytest.raises(ValueError, match="has expired: a result is kept 1 s after it is first retrieved") as e:
        expired.result(timeout=30)
    assert "with status 404" in str(e.value)
    unknown = _APIFuture(types.OptimStepResponse, tc.holder, types.UntypedAPIFuture(request_id="req-" + "0" * 32),
                         time.time(), "OptimStep")
    with pytest.raises(ValueError, match="unknown request_id") as e:
        unknown.result(timeout=30)
    assert "with status 404" in str(e.value) and "expired" not in str(e.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restart_after_the_sweep_rebuilds_a_run_exactly(tmp_path):
    port = str(_free_port())
    # Snapshots every 1 s: a run's latest snapshot is a few steps back, so the restart replays ops.
    args = RETENTION + ["--snapshot-interval-s", "1", "--snapshot-budget", "1", "--port", port]
    srv = start_server(tmp_path, [TINY], args)
    steps = 16
    try:
        sc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
        reference = _train(sc.create_lora_training_client(base_model=TINY, rank=8, seed=5).result(), range(steps))
        tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=5).result()
        first = _train(tc, range(steps // 2 - 1))
        # A snapshot is taken after an optim_step once 1 s has passed since the last: on a fast machine
        # all 8 steps take under 1 s and only the first step's snapshot would exist. Waiting out the
        # interval before the last step makes its snapshot the latest (sleeping changes no loss).
        time.sleep(1.2)
        first += _train(tc, range(steps // 2 - 1, steps // 2))
        # The sweep deleted the ops before the run's latest snapshot.
        _wait(lambda: len(_rows(tmp_path, tc.model_id)) < steps // 2)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        srv = start_server(tmp_path, [TINY], args)
        rest = _train(tc, range(steps // 2, steps))  # the same client: its polls and seq_ids go on
        recovered = [line for line in srv.lines if "server recovered" in line]
        assert recovered
    finally:
        srv.stop()
    assert first + rest == reference
