"""The unmodified SDK against `tinkerd serve --engine-ranks 2`: the tiny model's decoder FSDP2-sharded
over two gloo ranks (engine/sharding.py, docs/sharding.md) trains and samples as one rank does.

The one-rank reference is the shared conformance server (the same tiny model, unsharded): the same
adapter seed, the same five steps, then losses, the exported LoRA weights and sampled tokens and
logprobs are compared. Batches of 3, 1 and 2 datums put an uneven block, and an empty one (a rank
that runs only a dummy token to stay in the collectives), on the ranks. Then rank 1 is SIGKILLed
mid-loop: the engine restarts whole and the loop's losses equal an uninterrupted one's.
"""

from __future__ import annotations

import os
import re
import signal

import httpx

import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from tests.conformance.conftest import TINY
from tests.chaos import engine_pid, recoveries
from tests.conformance.sft import next_token_datum
from tests.serverproc import API_KEY, start_server

weights = pytest.importorskip("tinker_cookbook.weights")

TEXTS = [list(range(2000, 2013)), [3000, 17, 2010, 2011, 99, 5, 4000, 4001], list(range(5000, 5021, 2))]
BATCHES = [[0, 1, 2], [1], [2, 0], [0, 1, 2], [2]]  # datum indices per step
PROMPT = [3000, 2000, 2001, 2002, 2003]
TOL = 1e-5
# Adam's first steps are ~lr * sign(g) at its default eps 1e-8: an element whose gradient nearly
# cancels (a head LoRA row of a token that is never a target) turns the ranks' other summation order
# into an lr-sized difference (measured: one of 607k lm_head lora_B elements 2.2e-5 apart after five
# steps). With eps 1e-3 an update moves at most lr * |dg| / eps for a gradient difference dg, so
# gradients that agree to fp32 rounding give weights that agree far inside the tolerance, and the
# elements whose gradients are well above eps still move ~lr per step.
ADAM = types.AdamParams(learning_rate=1e-4, eps=1e-3)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("tinkerd-ranks"), [TINY], ["--threads", "1", "--engine-ranks", "2"])
    yield srv
    srv.stop()


def _run(url: str, tmp_path) -> dict:
    """Five SFT steps on a fresh seeded adapter; the losses, forward logprobs, LoRA weights, samples."""
    sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=5).result()
    data = [next_token_datum(t) for t in TEXTS]
    losses = []
    for step, batch in enumerate(BATCHES):
        fb = tc.forward_backward([data[i] for i in batch], "cross_entropy")
        tc.optim_step(ADAM)
        out = fb.result()
        tokens = sum(len(TEXTS[i]) - 1 for i in batch)
        losses.append((out.metrics["loss:sum"], out.metrics["loss:sum"] / tokens))
    forward = tc.forward(data, "cross_entropy").result()
    alone = tc.forward([data[1]], "cross_entropy").result()  # rank 1 runs only its dummy token
    ext = tc.save_weights_external("final").result().path
    adapter = weights.download(tinker_path=ext, output_dir=str(tmp_path), base_url=url)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROMPT)
    seeded = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)).result()
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0)).result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + greedy.sequences[0].tokens)).result()
    outputs = forward.loss_fn_outputs + alone.loss_fn_outputs
    return {"losses": losses, "forward": [o["logprobs"].to_numpy() for o in outputs],
            "lora": load_file(f"{adapter}/adapter_model.safetensors"),
            "sequences": [(s.tokens, s.logprobs) for s in seeded.sequences + greedy.sequences],
            "scored": scored[1:]}


def test_two_ranks_train_and_sample_as_one(server, sharded, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)  # for the cookbook's download
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    one = _run(server.url, tmp_path / "one")
    two = _run(sharded.url, tmp_path / "two")
    # Losses: the sums within 1e-5 relative, the per-token means within 1e-5.
    for (sum1, mean1), (sum2, mean2) in zip(one["losses"], two["losses"], strict=True):
        assert sum2 == pytest.approx(sum1, rel=TOL) and abs(mean2 - mean1) <= TOL, (one["losses"], two["losses"])
    for a, b in zip(one["forward"], two["forward"], strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=TOL)
    assert one["lora"].keys() == two["lora"].keys()
    moved = max(np.abs(one["lora"][k]).max() for k in one["lora"] if "lora_B" in k)
    assert moved > 20 * TOL  # B starts at zero: five steps of 1e-4 moved it ~50x the tolerance
    for key, value in one["lora"].items():
        np.testing.assert_allclose(two["lora"][key], value, rtol=0, atol=TOL, err_msg=key)
    for (tokens1, lps1), (tokens2, lps2) in zip(one["sequences"], two["sequences"], strict=True):
        assert tokens2 == tokens1
        np.testing.assert_allclose(lps2, lps1, rtol=0, atol=TOL)
    np.testing.assert_allclose(two["scored"], one["scored"], rtol=0, atol=TOL)


def _recomputed_layers(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(r"^tinkerd_recomputed_layers_total (\S+)$", text, re.M).group(1))


def test_ranks_that_recompute_their_activations_train_and_sample_to_the_same_bits(sharded, tmp_path, monkeypatch):
    """--activation-memory-gb 0: every decoder layer of every rank replays its forward in the backward
    (engine/recompute.py), under FSDP2, whose hooks unshard the layer's weights before its backward
    and so before the replay. Losses, logprobs, LoRA weights and samples equal the keeping ranks'."""
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    srv = start_server(tmp_path / "srv", [TINY], ["--threads", "1", "--engine-ranks", "2", "--activation-memory-gb", "0"])
    try:
        replayed = _run(srv.url, tmp_path / "replayed")
        layers = _recomputed_layers(srv.url)
    finally:
        srv.stop()
    kept = _run(sharded.url, tmp_path / "kept")
    assert layers >= 2 * len(BATCHES) and _recomputed_layers(sharded.url) == 0  # the tiny model's 2 layers a step
    assert replayed["losses"] == kept["losses"]
    for a, b in zip(replayed["forward"], kept["forward"], strict=True):
        assert np.array_equal(a, b)
    assert replayed["lora"].keys() == kept["lora"].keys()
    assert all(np.array_equal(replayed["lora"][k], kept["lora"][k]) for k in kept["lora"])
    assert replayed["sequences"] == kept["sequences"] and replayed["scored"] == kept["scored"]


def _rank1_pid(server_pid: int) -> int:
    """Rank 1 of the server's engine: the child of rank 0 (the engine process) that runs tinkerd.engine.sharding."""
    rank0 = engine_pid(server_pid)
    children = [c for t in os.listdir(f"/proc/{rank0}/task") for c in open(f"/proc/{rank0}/task/{t}/children").read().split()]
    (pid,) = [int(c) for c in children if b"tinkerd.engine.sharding" in open(f"/proc/{c}/cmdline", "rb").read()]
    return pid


def test_a_dead_rank_restarts_the_engine_and_loses_nothing(sharded):
    sc = tinker.ServiceClient(base_url=sharded.url, api_key=API_KEY)
    data = [next_token_datum(t) for t in TEXTS]

    def loop(kill_at: int | None) -> list[float]:
        tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=6).result()
        losses = []
        for step in range(4):
            if step == kill_at:
                os.kill(_rank1_pid(sharded.proc.pid), signal.SIGKILL)
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3))
            losses.append(fb.result().metrics["loss:sum"])
        return losses

    uninterrupted = loop(None)
    before = len(recoveries(sharded.lines))
    assert loop(kill_at=2) == uninterrupted
    assert len(recoveries(sharded.lines)) > before  # the kill was seen: rank 0 stopped, the engine was rebuilt
