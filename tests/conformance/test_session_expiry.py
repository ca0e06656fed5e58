"""Nothing lost when a client goes quiet, when a loaded checkpoint is deleted, or when an RL loop
writes a sampler per step: through the unmodified SDK against a live server whose sessions expire
after 3 s (the SDK heartbeats every 10 s, so a session with no requests soon counts as gone)."""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest
import tinker
from tinker import types

from tests.chaos import engine_pid, recoveries
from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY, start_server

EXPIRY_S = 3
KEPT = 2  # --ephemeral-samplers-kept
ADAM = types.AdamParams(learning_rate=1e-2)
PROMPT = types.ModelInput.from_ints([1000, 1001, 1002, 1003])


@pytest.fixture(scope="module")
def quiet_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("tinkerd-expiry"), [TINY],
                       ["--threads", "1", "--session-expiry-s", str(EXPIRY_S), "--ephemeral-samplers-kept", str(KEPT)])
    yield srv
    srv.stop()


def _client(srv) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)


def _batch(step: int) -> list[types.Datum]:
    rng = random.Random(step)
    out = []
    for _ in range(2):
        toks = [rng.randrange(1, 5000) for _ in range(rng.randrange(8, 24))]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]}))
    return out


def _train(tc, steps) -> list[float]:
    futures = []
    for step in steps:
        futures.append(tc.forward_backward(_batch(step), "cross_entropy"))
        tc.optim_step(ADAM)
    return [f.result().metrics["loss:sum"] for f in futures]


def _status(srv) -> dict:
    r = httpx.get(f"{srv.url}/api/v1/engine_status", headers={"X-API-Key": API_KEY}, timeout=30)
    r.raise_for_status()
    return r.json()


def _wait_for(srv, done, what: str, timeout_s: float = 180) -> dict:
    """Poll engine_status until done(status); a bound on waiting, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _status(srv)
        if done(status):
            return status
        time.sleep(0.3)
    raise AssertionError(f"{what} never happened; last engine_status: {status}")


def _greedy(sampler) -> list[int]:
    out = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=8, temperature=0.0)).result()
    return list(out.sequences[0].tokens)


def test_a_quiet_session_is_released_and_resumes_bit_exact(quiet_server):
    srv = quiet_server
    ref = _client(srv).create_lora_training_client(base_model=TINY, rank=4, seed=11).result()
    ref_losses = _train(ref, range(6))

    sc = _client(srv)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=11).result()
    losses = _train(tc, range(3))
    # Step 3's gradients are accumulated but not applied when the client goes quiet: the release
    # must keep them too (they are rebuilt by replaying this forward_backward).
    losses.append(tc.forward_backward(_batch(3), "cross_entropy").result().metrics["loss:sum"])
    saved = tc.save_state("before-quiet").result().path
    sampler = tc.save_weights_and_get_sampling_client().result()
    before = _greedy(sampler)

    # Quiet: no requests, and the heartbeat lapses. Every session here goes quiet, so the engine ends
    # up holding nothing, and reports so.
    status = _wait_for(srv, lambda s: tc.model_id in s["released_model_ids"] and ref.model_id in s["released_model_ids"]
                       and s["training_adapters"] == 0 and s["sampler_adapters"] == 0, "releasing the quiet sessions")
    assert status["training_adapters"] == 0

    # The state saved by the released session loads into a new client and continues exactly.
    fresh = _client(srv).create_training_client_from_state_with_optimizer(saved).result()
    fresh_losses = _train(fresh, range(3, 6))
    assert fresh_losses == ref_losses[3:]

    # The client comes back: its next ops rebuild its adapter, with step 3's pending gradients.
    tc.optim_step(ADAM).result()
    losses += _train(tc, range(4, 6))
    assert losses == ref_losses
    assert tc.model_id not in _status(srv)["released_model_ids"]
    # The sampler's weights were dropped from memory only: the same greedy continuation.
    assert _greedy(sampler) == before
    assert not [line for line in srv.lines if "ERROR" in line or "Traceback" in line]


def test_a_deleted_checkpoint_is_not_needed_to_recover_a_run_loaded_from_it(quiet_server):
    srv = quiet_server
    sc = _client(srv)
    src = sc.create_lora_training_client(base_model=TINY, rank=4, seed=5).result()
    _train(src, range(2))
    path = src.save_state("to-delete").result().path
    ref_losses = _train(sc.create_training_client_from_state_with_optimizer(path).result(), range(2, 6))

    tc = sc.create_training_client_from_state_with_optimizer(path).result()
    losses = [tc.forward_backward(_batch(2), "cross_entropy").result().metrics["loss:sum"]]
    tinker.RestClient(base_url=srv.url, api_key=API_KEY).delete_checkpoint_from_tinker_path(path).result()
    kills = len(recoveries(srv.lines))
    os.kill(engine_pid(srv.proc.pid), signal.SIGKILL)
    # The next op meets the dead engine: it is restarted and every loaded run rebuilt from its last
    # snapshot (for tc, the one written right after the load) plus its forward_backward since.
    tc.optim_step(ADAM).result()
    losses += _train(tc, range(3, 6))
    assert len(recoveries(srv.lines)) == kills + 1
    assert losses == ref_losses
    assert not [line for line in srv.lines if "cannot replay" in line or "replay of" in line or "rebuilding" in line]


def test_ephemeral_samplers_beyond_the_newest_are_deleted_once_unused(quiet_server):
    srv = quiet_server
    sc = _client(srv)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    first = tc.save_weights_and_get_sampling_client().result()
    session = first._sampling_session_id.rsplit(":sample:", 1)[0]
    ephemeral = srv.data_dir / "checkpoints" / "_ephemeral"

    def on_disk() -> list[str]:
        return sorted(p.name for p in ephemeral.iterdir() if p.name.startswith(session + ":"))

    # A long request on the oldest sampler while newer ones supersede it: it must finish normally
    # (its files are deleted only once it no longer runs).
    long = first.sample(PROMPT, 1, types.SamplingParams(max_tokens=48, temperature=0.0, stop=[]))
    samplers = [first]
    for step in range(KEPT + 2):
        _train(tc, [step])
        samplers.append(tc.save_weights_and_get_sampling_client().result())
    assert len(long.result().sequences[0].tokens) == 48
    samplers.append(tc.save_weights_and_get_sampling_client().result())  # prunes whatever was spared

    newest = [s._sampling_session_id for s in samplers[-KEPT:]]
    assert on_disk() == sorted(newest)
    for s in samplers[-KEPT:]:
        assert len(_greedy(s)) == 8
    with pytest.raises(Exception, match="unknown sampling_session_id"):
        samplers[0].sample(PROMPT, 1, types.SamplingParams(max_tokens=2)).result()
