"""The sampler's two shortcuts against the plain HF paths they replace, on both test architectures:
the fused decode step (decode.py) against the HF decoder body, and packed prefill of several prompts
in one forward against prefilling each alone. Shapes: B rows, H hidden, V vocab.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinkerd.engine.engine import Engine
from tinkerd.engine.sampler.decode import FusedDecode
from tinkerd.engine.sampler.prefill import Prefill, advance_packed
from tinkerd.engine.sampler.adapters import split_model
from tinkerd.engine.sampler.sample import Sampler, SamplerConfig
from tinkerd.types import LoraSpec, SampleOp, SamplingParams

MODELS = ["tinkerd/tiny-qwen3", "tinkerd/tiny-llama"]
PROMPTS = [[9707, 11, 1879, 0, 220, 3555, 13], [1416, 2585, 525], [498, 30, 11454, 9707, 11, 1879, 0, 220, 3555, 13, 1416]]


@pytest.fixture(scope="module")
def eng(models_dir) -> Engine:
    e = Engine(models_dir)
    gen = torch.Generator().manual_seed(3)
    for name in MODELS:
        pool = e.load_base_model(name).pool
        for i in range(2):  # two adapters with non-zero B, so per-row routing changes the numbers
            a = pool.create(f"{name}-a{i}", LoraSpec(rank=4, alpha=8, seed=i), trainable=True)
            with torch.no_grad():
                for _, b in a.weights.values():
                    b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
    return e


def decode_all(eng: Engine, name: str, config: SamplerConfig, monkeypatch) -> tuple[Sampler, dict]:
    """Three requests (base, adapter 0, adapter 1; one sampled at temperature 1) decoded together."""
    from tinkerd.engine.sampler import sample as sample_mod

    monkeypatch.setattr(sample_mod, "acquire_adapter", lambda rt, path, max_idle: rt.pool.acquire(path) if path else None)
    sampler = Sampler(eng.runtime(name), config)
    adapters = [None, f"{name}-a0", f"{name}-a1"]
    for i, (prompt, adapter) in enumerate(zip(PROMPTS, adapters)):
        params = SamplingParams(max_tokens=12, temperature=1.0 if i == 2 else 0.0, seed=11, stop_at_eos=False)
        sampler.admit(f"r{i}", SampleOp(name, adapter, np.array(prompt), params, num_samples=2 if i == 2 else 1))
    results = {}
    while sampler.active_rows:
        results.update(sampler.step())
    return sampler, results


@pytest.mark.parametrize("name", MODELS)
def test_fused_decode_equals_the_hf_body(eng, name, monkeypatch):
    fused, fast = decode_all(eng, name, SamplerConfig(fused_decode=True), monkeypatch)
    plain, slow = decode_all(eng, name, SamplerConfig(fused_decode=False), monkeypatch)
    assert fused.fused is not None and plain.fused is None  # both architectures take the fused path
    for ticket in slow:
        for f, s in zip(fast[ticket].sequences, slow[ticket].sequences):
            assert f.tokens == s.tokens and f.stop_reason == s.stop_reason
            np.testing.assert_allclose(f.logprobs, s.logprobs, rtol=1e-5, atol=1e-5)  # float rounding only


@pytest.mark.parametrize("base_only", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_fused_decode_hidden_states_match_one_hf_step(eng, name, base_only):
    """One step on a batch cache directly: the fused hidden states equal the HF body's, with rows
    on two adapters and the base model, and with base rows only (the step that skips adapters)."""
    from tinkerd.engine.sampler.kv import BatchCache

    rt = eng.runtime(name)
    body, _ = split_model(rt.model)
    step = FusedDecode.build(body)
    assert step is not None
    with torch.inference_mode():
        prefills = []
        for prompt in PROMPTS:
            pf = Prefill.start(np.array(prompt), rt.model.config, torch.device("cpu"), False, 0, None)
            rt.ctx.set_single(-1)
            pf.advance(body, None, len(prompt))
            prefills.append(pf)
        caches = []
        for _ in range(2):
            c = BatchCache(len(body.layers))
            c.join([(pf.cache, 1) for pf in prefills], [64] * len(prefills))
            caches.append(c)
        tokens = torch.tensor([5, 17, 2585])
        slots = [-1, rt.pool.get(f"{name}-a0").slot, rt.pool.get(f"{name}-a1").slot]
        rt.ctx.set_rows([-1] * 3 if base_only else slots)
        rt.ctx.sampling = True
        try:
            positions, mask = caches[0].step_inputs()
            want = body(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, cache=caches[0],
                        use_cache=True).last_hidden_state[:, -1]
            positions, mask = caches[1].step_inputs()
            got = step(tokens, positions, mask, caches[1], adapters=not base_only)
        finally:
            rt.ctx.sampling = False
            rt.ctx.clear()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    w = caches[0].width
    for a, b in zip(caches[0].layers, caches[1].layers):  # the new column written alike
        torch.testing.assert_close(b.keys[:, :, : w + 1], a.keys[:, :, : w + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.values[:, :, : w + 1], a.values[:, :, : w + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_packed_prefill_equals_each_prompt_alone(eng, name):
    rt = eng.runtime(name)
    body, head = split_model(rt.model)

    def start():
        return [Prefill.start(np.array(p), rt.model.config, torch.device("cpu"), True, 3, None) for p in PROMPTS]

    calls = []
    hook = body.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    with torch.inference_mode():
        rt.ctx.set_single(rt.pool.get(f"{name}-a0").slot)
        alone = start()
        for pf in alone:
            pf.advance(body, head, 1000)
        calls.clear()
        packed = start()
        advance_packed(packed, body, head)
        rt.ctx.clear()
    hook.remove()
    assert calls == [torch.Size([1, sum(map(len, PROMPTS))])]  # one forward for all three
    for a, p in zip(alone, packed):
        assert p.finished and p.chunk_calls == [len(a.prompt)]
        torch.testing.assert_close(p.last_hidden, a.last_hidden, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(p.logprobs, a.logprobs, atol=1e-5)
        assert (p.topk[0][1:] == a.topk[0][1:]).all()
        for la, lp in zip(a.cache.layers, p.cache.layers):
            torch.testing.assert_close(lp.keys, la.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lp.values, la.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [49152, 151936, 5000, 1500, 1024, 300])
def test_greedy_tokens_is_argmax(vocab):
    """The block-maxima argmax picks exactly torch's argmax: the first index of each row's maximum,
    with ties (integer-valued logits), the maximum in the ragged last block, and NaN rows."""
    from tinkerd.engine.sampler.rules import greedy_tokens

    gen = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        logits = torch.randn(8, vocab, generator=gen)
        if trial % 3 == 0:
            logits = (logits * 2).round()  # many equal maxima in many blocks
        if trial % 4 == 1:
            logits[:, -1] = 50.0  # the last column, in the ragged end where there is one
        if trial % 4 == 2:
            logits[3, vocab // 2] = float("nan")
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1)), trial
