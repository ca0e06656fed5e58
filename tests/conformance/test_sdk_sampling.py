"""Sampling through the unmodified tinker 0.38.0 SDK against a live tinkerd.

Pinned: greedy decoding equals a naive full-recompute generate; sampled logprobs equal the
trainer's forward logprobs; a fresh adapter samples like the base model; seeds reproduce, also
inside a fused batch; requests of several clients and adapters fused into one decode batch return
what each returns alone; stops, prompt logprobs and top-k behave as the SDK and cookbook expect;
every weight source works; bad requests fail alone with a `user` error.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.sft import next_token_datum
from tests.serverproc import API_KEY

PROMPT = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30]  # 12 ids
VOCAB = 151669
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])


def _mi(tokens: list[int]) -> types.ModelInput:
    return types.ModelInput.from_ints(tokens)


@pytest.fixture(scope="module")
def sc(server) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.url, api_key=API_KEY)


@pytest.fixture(scope="module")
def base(sc):
    return sc.create_sampling_client(base_model=TINY).result()


def _trained(sc, seed: int, text: list[int]):
    """A training client trained 4 steps (non-zero LoRA B) and its ephemeral sampler."""
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=seed).result()
    for _ in range(4):
        tc.forward_backward([next_token_datum(text)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2))
    return tc, tc.save_weights_and_get_sampling_client().result()


@pytest.fixture(scope="module")
def trained(sc):
    return _trained(sc, 1, PROMPT + [100, 200, 300, 400])


@pytest.fixture(scope="module")
def trained2(sc):
    return _trained(sc, 2, [500, 600] + PROMPT)


def test_greedy_equals_naive_generate_and_logprobs_equal_the_trainers(trained):
    tc, sampler = trained
    seq = sampler.sample(_mi(PROMPT), 1, GREEDY).result().sequences[0]
    assert len(seq.tokens) == 8 and seq.stop_reason == "length"
    # Naive generate: every token from a fresh full forward of everything before it.
    naive: list[int] = []
    for _ in range(8):
        naive += sampler.sample(_mi(PROMPT + naive), 1, types.SamplingParams(max_tokens=1, temperature=0.0)).result().sequences[0].tokens
    assert seq.tokens == naive
    # The trainer's forward of the whole sequence scores the sampled tokens the same (fp32, 1e-4).
    sampled = sampler.sample(_mi(PROMPT), 2, types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])).result()
    for s in [seq, *sampled.sequences]:
        out = tc.forward([next_token_datum(PROMPT + s.tokens)], "cross_entropy").result()
        trainer = out.loss_fn_outputs[0]["logprobs"].to_numpy()[-len(s.tokens):]
        np.testing.assert_allclose(s.logprobs, trainer, atol=1e-4)


def test_a_fresh_adapter_samples_exactly_like_the_base_model(sc, base):
    fresh = sc.create_lora_training_client(base_model=TINY, rank=8, seed=9).result().save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=42)
    a = base.sample(_mi(PROMPT), 3, params).result()
    b = fresh.sample(_mi(PROMPT), 3, params).result()
    for x, y in zip(a.sequences, b.sequences):
        assert x.tokens == y.tokens
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    np.testing.assert_allclose(base.compute_logprobs(_mi(PROMPT)).result()[1:], fresh.compute_logprobs(_mi(PROMPT)).result()[1:], atol=1e-5)


def test_seeded_sampling_reproduces_alone_and_inside_a_fused_batch(base, trained, trained2):
    params = types.SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=1234, stop=[])
    first = base.sample(_mi(PROMPT), 3, params).result()
    assert [s.tokens for s in base.sample(_mi(PROMPT), 3, params).result().sequences] == [s.tokens for s in first.sequences]
    assert len({tuple(s.tokens) for s in first.sequences}) == 3  # samples are independent draws
    # The same request among others from other clients, all in flight together.
    others = [c.sample(_mi(PROMPT[: 3 + i]), 2, types.SamplingParams(max_tokens=12, temperature=1.0))
              for i, c in enumerate([trained[1], trained2[1], base, trained[1]])]
    again = base.sample(_mi(PROMPT), 3, params)
    assert [s.tokens for s in again.result().sequences] == [s.tokens for s in first.sequences]
    for f in others:
        f.result()
    other_seed = base.sample(_mi(PROMPT), 3, types.SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=1235, stop=[]))
    assert [s.tokens for s in other_seed.result().sequences] != [s.tokens for s in first.sequences]
    unseeded = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[])
    assert base.sample(_mi(PROMPT), 1, unseeded).result().sequences[0].tokens != base.sample(_mi(PROMPT), 1, unseeded).result().sequences[0].tokens


def test_concurrent_clients_and_adapters_return_what_they_return_alone(sc, base, trained, trained2):
    named = sc.create_sampling_client(model_path=trained2[0].save_weights_for_sampler("fuse").result().path).result()
    fresh = sc.create_lora_training_client(base_model=TINY, rank=4, seed=5).result().save_weights_and_get_sampling_client().result()
    clients = {"base": base, "ephemeral": trained[1], "named": named, "fresh": fresh}
    requests = []
    for i, (name, client) in enumerate(clients.items()):
        prompt = _mi(PROMPT[: 4 + 2 * i])
        requests.append((name, "greedy", client, prompt, 1, types.SamplingParams(max_tokens=6 + i, temperature=0.0, stop=[]), {}))
        requests.append((name, "seeded", client, prompt, 2, types.SamplingParams(max_tokens=9 - i, temperature=1.0, seed=i, top_k=50, stop=[]),
                         {"include_prompt_logprobs": True, "topk_prompt_logprobs": 2}))
    alone = [client.sample(p, n, sp, **kw).result() for _, _, client, p, n, sp, kw in requests]
    futures = [client.sample(p, n, sp, **kw) for _, _, client, p, n, sp, kw in requests]  # all in flight at once
    fused = [f.result() for f in futures]
    for (name, kind, *_), a, f in zip(requests, alone, fused):
        assert [s.tokens for s in f.sequences] == [s.tokens for s in a.sequences], (name, kind)
        for x, y in zip(f.sequences, a.sequences):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
        if a.prompt_logprobs is not None:
            np.testing.assert_allclose(f.prompt_logprobs[1:], a.prompt_logprobs[1:], atol=1e-4)
            assert [[t for t, _ in row] for row in f.topk_prompt_logprobs[1:]] == [[t for t, _ in row] for row in a.topk_prompt_logprobs[1:]]
    # The adapters really differ, so fusing could have mixed them up.
    greedy = {name: a.sequences[0].tokens for (name, kind, *_), a in zip(requests, alone) if kind == "greedy"}
    assert greedy["ephemeral"] != base.sample(_mi(PROMPT[:6]), 1, types.SamplingParams(max_tokens=7, temperature=0.0, stop=[])).result().sequences[0].tokens


def test_stops_token_ids_strings_and_none(base, trained):
    # The training client's tokenizer: SamplingClient.get_tokenizer asks the HF hub for the base
    # model's name, which a local-only name like tinkerd/tiny-qwen3 is not.
    tok = trained[0].get_tokenizer()
    free = base.sample(_mi(PROMPT), 1, types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])).result().sequences[0]
    assert len(free.tokens) == 12 and free.stop_reason == "length"
    stop_id = free.tokens[3]
    n = free.tokens.index(stop_id) + 1
    seq = base.sample(_mi(PROMPT), 1, types.SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_id])).result().sequences[0]
    assert seq.tokens == free.tokens[:n] and seq.stop_reason == "stop"  # the stop token is included, once
    assert len(seq.logprobs) == len(seq.tokens)
    text = tok.decode(free.tokens[4:7])
    stop_str = text[len(text) // 2:]
    seq = base.sample(_mi(PROMPT), 1, types.SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_str])).result().sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens == free.tokens[: len(seq.tokens)]
    assert stop_str in tok.decode(seq.tokens) and stop_str not in tok.decode(seq.tokens[:-1])


def test_prompt_logprobs_topk_and_compute_logprobs_agree(base):
    lp = base.compute_logprobs(_mi(PROMPT)).result()
    assert len(lp) == len(PROMPT) and lp[0] is None and all(isinstance(x, float) for x in lp[1:])
    res = base.sample(_mi(PROMPT), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=5).result()
    np.testing.assert_allclose(res.prompt_logprobs[1:], lp[1:], atol=1e-5)
    topk = res.topk_prompt_logprobs
    assert len(topk) == len(PROMPT) and topk[0] is None
    for i in range(1, len(PROMPT)):
        ids, lps = zip(*topk[i])
        assert len(ids) == 5 and list(lps) == sorted(lps, reverse=True)
        assert lps[0] >= lp[i] - 1e-5
        if PROMPT[i] in ids:
            assert lps[ids.index(PROMPT[i])] == pytest.approx(lp[i], abs=1e-5)
    # Only the last N positions scored, the rest None (the SDK checks that too).
    last3 = base.compute_logprobs(_mi(PROMPT), prompt_logprobs_last_n=3).result()
    assert last3[:-3] == [None] * (len(PROMPT) - 3)
    np.testing.assert_allclose(last3[-3:], lp[-3:], atol=1e-5)


def test_topk_sample_logprobs(base):
    seq = base.sample(_mi(PROMPT), 1, GREEDY, topk_sample_logprobs=3).result().sequences[0]
    assert len(seq.topk_logprobs) == len(seq.tokens)
    for token, logprob, row in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
        assert len(row) == 3 and row[0][0] == token and row[0][1] == pytest.approx(logprob, abs=1e-6)
        assert [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)


def test_every_weight_source_samples_its_own_weights(sc, base, trained):
    tc, ephemeral = trained
    sampler_path = tc.save_weights_for_sampler("src").result().path
    state_path = tc.save_state("src-state").result().path
    assert sampler_path.startswith("tinker://") and "/sampler_weights/" in sampler_path and "/weights/" in state_path
    want = ephemeral.sample(_mi(PROMPT), 1, GREEDY).result().sequences[0]
    for path in (sampler_path, state_path):
        got = sc.create_sampling_client(model_path=path).result().sample(_mi(PROMPT), 1, GREEDY).result().sequences[0]
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)
    assert base.sample(_mi(PROMPT), 1, GREEDY).result().sequences[0].tokens != want.tokens


BAD = {
    "max_tokens past the context": (PROMPT, types.SamplingParams(max_tokens=5000), {}, "context"),
    "empty prompt": ([], types.SamplingParams(max_tokens=2), {}, "empty"),
    "token id past the vocabulary": ([1, VOCAB + 5], types.SamplingParams(max_tokens=2), {}, "vocabulary"),
    "negative token id": ([1, -3], types.SamplingParams(max_tokens=2), {}, "vocabulary"),
    "top_k below -1": (PROMPT, types.SamplingParams(max_tokens=2, top_k=-2), {}, "top_k"),
    "top_p zero": (PROMPT, types.SamplingParams(max_tokens=2, top_p=0.0), {}, "top_p"),
    "top_p above one": (PROMPT, types.SamplingParams(max_tokens=2, top_p=1.5), {}, "top_p"),
    "negative temperature": (PROMPT, types.SamplingParams(max_tokens=2, temperature=-1.0), {}, "temperature"),
    "prompt top-k past the vocabulary": (PROMPT, types.SamplingParams(max_tokens=1), {"topk_prompt_logprobs": VOCAB + 1}, "topk_prompt_logprobs"),
    "sample top-k past the vocabulary": (PROMPT, types.SamplingParams(max_tokens=1), {"topk_sample_logprobs": VOCAB + 1}, "topk_sample_logprobs"),
    # 11 scored positions x 100k: over the 2^20 pairs a request may ask for (the vocabulary is 151k).
    "prompt top-k pairs over the cap": (PROMPT, types.SamplingParams(max_tokens=1), {"topk_prompt_logprobs": 100_000}, "pairs"),
    "sample top-k pairs over the cap": (PROMPT, types.SamplingParams(max_tokens=20), {"topk_sample_logprobs": 60_000}, "pairs"),
    # 8 x 4012 positions x 512 B of tiny-qwen3 KV = 16 MB, over the server's --sample-kv-cache-gb 0.01.
    "KV cache over the sampler's budget": (PROMPT, types.SamplingParams(max_tokens=4000), {"num_samples": 8}, "KV cache"),
}


def test_bad_requests_fail_alone_while_another_clients_good_ones_succeed(sc, base, trained):
    attacker = sc.create_sampling_client(base_model=TINY).result()
    victims = [(base, PROMPT[:5]), (trained[1], PROMPT[:9]), (base, PROMPT)]
    params = types.SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    alone = [c.sample(_mi(p), 2, params).result() for c, p in victims]
    good, bad = [], []
    for i, (name, (prompt, sp, kw, word)) in enumerate(BAD.items()):  # interleaved, all in flight
        c, p = victims[i % len(victims)]
        good.append(c.sample(_mi(p), 2, params))
        kw = dict(kw)
        bad.append((name, word, attacker.sample(_mi(prompt), kw.pop("num_samples", 1), sp, **kw)))
    for name, word, future in bad:
        # Refused at the edge (a 400: api/limits.py) or by the sampler (a failed future, category user).
        with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError)) as info:
            future.result()
        if isinstance(info.value, tinker.RequestFailedError):
            assert info.value.category == "user", (name, info.value)
        assert word in str(info.value), (name, str(info.value))
    for i, future in enumerate(good):
        assert [s.tokens for s in future.result().sequences] == [s.tokens for s in alone[i % len(victims)].sequences]


def test_a_grpo_group_sent_as_requests_and_resaved_sampler_weights_sample_their_own_weights(sc):
    """The cookbook's GRPO group (one request per sample, one prompt) and the RL loop's next
    save_weights_for_sampler under the same name: the server's prefix cache (engine/sampler/
    prefix.py) serves the group from one prefill, and never serves the new weights from the old one."""
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=4).result()
    text = PROMPT + [700, 800, 900]
    rounds = []
    for _ in range(2):
        tc.forward_backward([next_token_datum(text)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampler = sc.create_sampling_client(model_path=tc.save_weights_for_sampler("grpo").result().path).result()
        params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        group = [sampler.sample(_mi(PROMPT), 1, params) for _ in range(4)]
        together_response = sampler.sample(_mi(PROMPT), 4, params).result()
        together = together_response.sequences
        # One of the five requests prefilled; the others followed it or found its prefill kept.
        hits = [f.result().prompt_cache_hit_tokens for f in group] + [together_response.prompt_cache_hit_tokens]
        assert sorted(hits) == [0] + [len(PROMPT)] * 4
        for f, want in zip(group, together):
            got = f.result().sequences[0]
            assert got.tokens == want.tokens
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
        # The trainer's forward of these weights scores the sampled tokens the same.
        out = tc.forward([next_token_datum(PROMPT + together[0].tokens)], "cross_entropy").result()
        trainer = out.loss_fn_outputs[0]["logprobs"].to_numpy()[-len(together[0].tokens):]
        np.testing.assert_allclose(together[0].logprobs, trainer, atol=1e-4)
        rounds.append(together[0].logprobs)
    assert not np.allclose(rounds[0], rounds[1], atol=1e-3)  # the second save did change the weights
