"""Inflight samplers through the unmodified tinker 0.38.0 SDK:
`save_weights_and_get_sampling_client(kind="inflight")` (docs/compatibility.md, control/inflight.py).

Pinned against snapshot samplers saved from the same weights: an inflight client samples exactly
what the snapshot of the run's latest inflight save samples (greedy and seeded), keeps its weights
across optim_steps until the next inflight save, follows that save (as does the new client, on its
own session), and misuse of the request is a `user` 400.
"""

from __future__ import annotations

import httpx
import numpy as np
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.sft import train_on
from tests.serverproc import API_KEY

PROMPT = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30]
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
SEEDED = types.SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[])


def _train(tc, text: list[int], steps: int) -> None:
    train_on(tc, text, steps, learning_rate=5e-2)


def _out(client) -> tuple:
    """What a sampler answers for one greedy and one seeded request (tokens; logprobs rounded)."""
    res = [client.sample(types.ModelInput.from_ints(PROMPT), n, p).result() for n, p in ((1, GREEDY), (2, SEEDED))]
    return tuple(tuple(s.tokens) for r in res for s in r.sequences), [np.asarray(s.logprobs) for r in res for s in r.sequences]


def _same(a, b) -> bool:
    return a[0] == b[0] and all(np.allclose(x, y, atol=1e-5) for x, y in zip(a[1], b[1]))


def test_inflight_clients_sample_the_runs_latest_inflight_save(sc):
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=11).result()
    _train(tc, PROMPT + [100, 200, 300, 400, 500, 600, 700, 800], 3)
    a = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    w1 = _out(tc.save_weights_and_get_sampling_client().result())  # a snapshot of the same weights
    assert _same(_out(a), w1)

    # Training continues: the inflight target moves only with the next inflight save.
    _train(tc, PROMPT + [900, 1000, 1100, 1200, 1300, 1400, 1500, 1600], 4)
    assert _same(_out(a), w1)
    b = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    w2 = _out(tc.save_weights_and_get_sampling_client().result())
    assert w2[0] != w1[0]  # the steps changed what greedy and seeded sampling give
    assert _same(_out(b), w2) and _same(_out(a), w2)  # the earlier client follows the new save
    assert b._sampling_session_id != a._sampling_session_id  # each save: a new session (KV namespace)

    # And again, across more steps and a third save; several saves keep only a few adapters on disk.
    _train(tc, PROMPT + [1700, 1800, 1900, 2000, 2100, 2200, 2300, 2400], 4)
    for _ in range(5):
        c = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    w3 = _out(tc.save_weights_and_get_sampling_client().result())
    assert w3[0] != w2[0]
    for client in (a, b, c):
        assert _same(_out(client), w3)


def test_inflight_runs_are_separate_and_snapshots_stay_fixed(sc):
    t1 = sc.create_lora_training_client(base_model=TINY, rank=8, seed=21).result()
    t2 = sc.create_lora_training_client(base_model=TINY, rank=8, seed=22).result()
    _train(t1, PROMPT + [100, 200, 300, 400], 3)
    snap = t1.save_weights_and_get_sampling_client().result()
    before = _out(snap)
    i1 = t1.save_weights_and_get_sampling_client(kind="inflight").result()
    i2 = t2.save_weights_and_get_sampling_client(kind="inflight").result()  # t2 is untrained: LoRA B = 0
    base = _out(sc.create_sampling_client(base_model=TINY).result())
    _train(t1, PROMPT + [900, 1000, 1100, 1200], 4)
    t1.save_weights_and_get_sampling_client(kind="inflight").result()
    assert _same(_out(i2), base)  # another run's inflight save does not move this run's target
    assert _same(_out(snap), before) and not _same(_out(i1), before)  # a snapshot stays, inflight moves


def _save(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/save_weights_for_sampler", json={"type": "save_weights_for_sampler", **body},
                      headers={"X-API-Key": API_KEY}, timeout=60)


def test_misused_inflight_saves_are_user_errors(server, sc):
    model_id = sc.create_lora_training_client(base_model=TINY, rank=8, seed=31).result().model_id
    cases = [
        ({"path": "named", "kind": "inflight"}, "no path"),
        ({"kind": "inflight"}, "sampling_session_seq_id"),
        ({"sampling_session_seq_id": 900, "kind": "inflight", "ttl_seconds": 3600}, "ttl_seconds"),
        ({"sampling_session_seq_id": 901, "kind": "latest"}, "kind"),
    ]
    for extra, words in cases:
        r = _save(server, {"model_id": model_id, "seq_id": 1, **extra})
        assert r.status_code == 400, (extra, r.status_code, r.text)
        assert r.json()["category"] == "user" and words in r.json()["error"], (extra, r.text)
