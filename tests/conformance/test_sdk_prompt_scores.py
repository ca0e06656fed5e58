"""target_prompt_logprobs and prompt_alt_tokens_k through the unmodified tinker 0.38.0 SDK, pinned
against the trainer's forward logprobs (an independent path: a fresh LoRA equals the base model)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY

PROMPT = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30]
P = len(PROMPT)
ONE = types.SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def base(sc):
    return sc.create_sampling_client(base_model=TINY).result()


@pytest.fixture(scope="module")
def forward(sc):
    """forward(ids [P-1]) -> the trainer's logprob of ids[i] after PROMPT[:i+1], for every i."""
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()

    def run(ids) -> np.ndarray:
        datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                            loss_fn_inputs={"target_tokens": [int(i) for i in ids]})
        out = tc.forward([datum], "cross_entropy").result()
        return out.loss_fn_outputs[0]["logprobs"].to_numpy()

    return run


def _ids(k: int) -> np.ndarray:
    ids = np.random.default_rng(3).integers(0, 151_669, size=(P - 1, k))
    ids[:, 0] = PROMPT[1:]
    ids[1, 1] = ids[6, 2] = -1
    return ids


def test_dense_targets_equal_the_trainers_logprobs(base, forward):
    ids = _ids(3)
    res = base.sample(types.ModelInput.from_ints(PROMPT), 1, ONE, include_prompt_logprobs=True,
                      target_prompt_logprobs=types.TensorData.from_numpy(ids)).result()
    got = res.target_prompt_logprobs.to_numpy()
    assert got.shape == (P - 1, 3) and got.dtype == np.float32
    for j in range(3):
        want = forward(np.maximum(ids[:, j], 0))
        want[ids[:, j] == -1] = 0.0
        np.testing.assert_allclose(got[:, j], want, atol=1e-4)
    np.testing.assert_allclose(got[:, 0], res.prompt_logprobs[1:], atol=1e-5)


def test_sparse_targets_come_back_sparse_in_the_same_layout(base, forward):
    ids = torch.full((P - 1, 4), -1, dtype=torch.int64)
    ids[P - 2, 2] = 42  # the SDK's own example: one candidate at the last prompt position
    ids[3, 0] = PROMPT[4]
    target = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert target.sparse_crow_indices is not None
    res = base.sample(types.ModelInput.from_ints(PROMPT), 1, ONE, target_prompt_logprobs=target).result()
    out = res.target_prompt_logprobs
    assert out.sparse_crow_indices == target.sparse_crow_indices and out.sparse_col_indices == target.sparse_col_indices
    dense = out.to_torch().numpy()
    assert dense.shape == (P - 1, 4) and np.count_nonzero(dense) == 2
    assert dense[P - 2, 2] == pytest.approx(float(forward([42] * (P - 1))[P - 2]), abs=1e-4)
    assert dense[3, 0] == pytest.approx(float(forward(PROMPT[1:])[3]), abs=1e-4)


def test_alt_tokens_greedy_seeded_and_their_logprobs(base, forward):
    res = base.sample(types.ModelInput.from_ints(PROMPT), 1, ONE, prompt_alt_tokens_k=2).result()
    ids, lps = res.prompt_alt_tokens.tokens.to_numpy(), res.prompt_alt_tokens.logprobs.to_numpy()
    assert ids.shape == lps.shape == (P - 1, 2) and (ids[:, 0] == ids[:, 1]).all()  # temperature 0: argmax
    np.testing.assert_allclose(lps[:, 0], forward(ids[:, 0]), atol=1e-4)
    # The argmax is at least as likely as the actual prompt token.
    assert (lps[:, 0] >= forward(PROMPT[1:]) - 1e-5).all()
    hot = types.SamplingParams(max_tokens=1, temperature=1.0, seed=9)
    a, b = (base.sample(types.ModelInput.from_ints(PROMPT), 1, hot, prompt_alt_tokens_k=5).result()
            for _ in range(2))
    draws = a.prompt_alt_tokens.tokens.to_numpy()
    assert (draws == b.prompt_alt_tokens.tokens.to_numpy()).all() and len(np.unique(draws)) > 5
    for j in range(5):
        np.testing.assert_allclose(a.prompt_alt_tokens.logprobs.to_numpy()[:, j], forward(draws[:, j]), atol=1e-4)


def test_bad_targets_and_k_are_user_400s(server, base):
    with pytest.raises(tinker.BadRequestError, match="target_prompt_logprobs"):
        base.sample(types.ModelInput.from_ints(PROMPT), 1, ONE,
                    target_prompt_logprobs=types.TensorData.from_numpy(np.zeros((P, 2), dtype=np.int64))).result()
    sid = base._sampling_session_id
    prompt = {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}
    bads = [
        {"target_prompt_logprobs": {"data": [0.5] * (P - 1), "dtype": "float32", "shape": [P - 1, 1]}},
        {"target_prompt_logprobs": {"data": [1] * 3, "dtype": "int64", "shape": [P - 1, 1]}},
        {"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [P - 1, 1],
                                    "sparse_crow_indices": [0, 5], "sparse_col_indices": [0]}},
        {"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [P - 1, 2**40]}},
        {"prompt_alt_tokens_k": 10**9},
        {"prompt_alt_tokens_k": -1},
    ]
    for i, extra in enumerate(bads):
        body = {"sampling_session_id": sid, "seq_id": 10_000 + i, "prompt": prompt,
                "sampling_params": {"max_tokens": 1}, **extra}
        r = httpx.post(f"{server.url}/api/v1/asample", json=body, headers={"X-API-Key": API_KEY}, timeout=60)
        assert r.status_code == 400 and r.json()["category"] == "user", (extra, r.text)
    # An id outside the vocabulary is the sampler's to refuse: a failed future naming it.
    with pytest.raises(tinker.RequestFailedError, match="vocabulary") as info:
        base.sample(types.ModelInput.from_ints(PROMPT), 1, ONE, target_prompt_logprobs=types.TensorData.from_numpy(
            np.full((P - 1, 1), 10**9, dtype=np.int64))).result()
    assert info.value.category == "user"
