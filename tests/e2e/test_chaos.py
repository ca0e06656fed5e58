"""Nothing lost: an SDK training loop survives SIGKILLs of the engine process and of the whole server,
and ends with exactly the losses, samples and weights of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.chaos import TINY, Killer, engine_pid, recoveries, training_loop
from tests.serverproc import API_KEY, logged_ops, start_server
from tinkerd.engine.checkpoints import read_adapter

STEPS = 40
ARGS = ["--threads", "1"]


def _adapter_dir(data_dir, tinker_path: str):
    run, seg, name = tinker_path[len("tinker://"):].split("/")
    return data_dir / "checkpoints" / run / seg / name


def _assert_same_adapter(a_dir, b_dir):
    a, b = read_adapter(a_dir), read_adapter(b_dir)
    assert a.step == b.step == STEPS
    assert set(a.weights) == set(b.weights)
    for name, (a_a, a_b) in a.weights.items():
        b_a, b_b = b.weights[name]
        assert torch.allclose(a_a, b_a, atol=1e-6, rtol=0) and torch.allclose(a_b, b_b, atol=1e-6, rtol=0), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("ref")
    srv = start_server(data_dir, [TINY], ARGS)
    try:
        result = training_loop(srv.url, STEPS)
    finally:
        srv.stop()
    return data_dir, result


@pytest.mark.slow
def test_engine_sigkilled_ten_times(reference, tmp_path):
    ref_dir, ref = reference
    srv = start_server(tmp_path, [TINY], ARGS)
    try:
        killer = Killer(srv.proc.pid, kills=10, server_lines=srv.lines, min_gap_s=0.2, max_gap_s=0.8)
        killer.start()
        result = training_loop(srv.url, STEPS)  # any client-visible failure raises here
        kills = len(killer.done)
    finally:
        srv.stop()
    assert kills >= 10
    assert result.losses == ref.losses
    assert result.samples == ref.samples
    _assert_same_adapter(_adapter_dir(ref_dir, ref.final_path), _adapter_dir(tmp_path, result.final_path))
    assert len(recoveries(srv.lines)) >= kills


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_whole_server_sigkilled_and_restarted(reference, tmp_path):
    ref_dir, ref = reference
    port = str(_free_port())
    srv = start_server(tmp_path, [TINY], ARGS + ["--port", port])
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = training_loop(srv.url, STEPS)
        except BaseException as e:  # surfaced by the assertion below
            box["error"] = e

    loop = threading.Thread(target=run)
    loop.start()
    time.sleep(4)  # mid-run: some steps done, more queued and in flight
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait()
    restarted = start_server(tmp_path, [TINY], ARGS + ["--port", port])
    try:
        loop.join(timeout=600)
    finally:
        restarted.stop()
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.losses == ref.losses
    assert result.samples == ref.samples
    _assert_same_adapter(_adapter_dir(ref_dir, ref.final_path), _adapter_dir(tmp_path, result.final_path))


def _pending(data_dir, request_type: str) -> int:
    return len(logged_ops(data_dir, request_type=request_type, status="pending"))


@pytest.mark.slow
def test_save_weights_external_accepted_before_a_server_restart_completes_after_it(tmp_path):
    port = str(_free_port())
    srv = start_server(tmp_path, [TINY], ARGS + ["--port", port])
    restarted = None
    try:
        tc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY).create_lora_training_client(
            base_model=TINY, rank=4, seed=3).result()
        toks = list(range(1000, 1020))
        datum = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        # A stopped engine runs nothing: the export is accepted (stored) and certainly still pending
        # when the server dies.
        engine = engine_pid(srv.proc.pid)
        os.kill(engine, signal.SIGSTOP)
        export = tc.save_weights_external("exported")
        while _pending(tmp_path, "SaveWeightsExternal") == 0:
            time.sleep(0.1)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        os.kill(engine, signal.SIGKILL)
        restarted = start_server(tmp_path, [TINY], ARGS + ["--port", port])
        path = export.result().path  # the SDK was polling all along
        assert path == f"tinker://{tc.model_id}/external_weights/exported"
        sampler = tc.save_weights_for_sampler("now").result().path
    finally:
        (restarted or srv).stop()
    exported = load_file(_adapter_dir(tmp_path, path) / "adapter_model.safetensors")
    current = load_file(_adapter_dir(tmp_path, sampler) / "adapter_model.safetensors")
    assert exported.keys() == current.keys()
    assert all(torch.equal(exported[k], current[k]) for k in exported)
    assert not any("cannot be resumed" in line for line in restarted.lines)
