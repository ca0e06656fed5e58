"""Images through vision-language models with LoRA equal HF + PEFT, and their sampler HF generate.

The models (engine/model/tiny.py), built from a config and a seed, each with a one-block vision tower
(patch 16, merge 2) and the released checkpoints' `preprocessor_config.json`: `tinkerd/tiny-qwen3-vl`,
a 2-layer Qwen3-VL language model (DeepStack on block 0), `tinkerd/tiny-qwen3.5-vl`, the 4-layer
hybrid Qwen3.5 (3 Gated DeltaNet layers, one gated attention) as `Qwen3_5ForConditionalGeneration`,
and `tinkerd/tiny-qwen3.5-moe-vl`, the same with a MoE block per layer (`Qwen3_5MoeForConditionalGeneration`;
its experts' LoRA against PEFT `target_parameters`, tests/parity/peft_oracle.py). Images go in as the API leaves them
(tinkerd/images.py: N placeholder positions and the encoded bytes); the oracle is HF's own
`Qwen3VLForConditionalGeneration` forward on the HF image processor's pixels, its M-RoPE positions
computed by its own forward, with PEFT `target_modules` LoRA (tinkerd's A/B copied in) in fp64
(tinkerd fp32): tolerance 1e-5 of the largest reference value, as in test_lora_parity.py.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from tests.parity import peft_oracle
from tests.parity.peft_oracle import assert_lora_grads_match
from tinkerd.engine.engine import Engine
from tinkerd.engine.model.registry import cache_dir_for
from tinkerd.engine.model.vision import solid_png
from tinkerd.engine.sampler import sample as sample_mod
from tinkerd.engine.sampler.sample import Sampler, SamplerConfig
from tinkerd.images import ChunkExpander, ImageLimits
from tinkerd.types import CreateModelOp, Datum, ForwardBackwardOp, ForwardBackwardResult, LoraSpec, SampleOp, SamplingParams

MODELS = ["tinkerd/tiny-qwen3-vl", "tinkerd/tiny-qwen3.5-vl", "tinkerd/tiny-qwen3.5-moe-vl"]
SPEC = LoraSpec(rank=4, alpha=8.0, seed=41)
LIMITS = ImageLimits(max_bytes=1 << 24, max_pixels=1 << 24)
VISION_START, VISION_END = 151652, 151653


def striped_png(size=(100, 70), seed=0) -> bytes:
    """An image with structure (not one colour), so patches differ from each other."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=MODELS)
def vl_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def vl_engine(models_dir, vl_name) -> Engine:
    engine = Engine(models_dir)
    engine.load_base_model(vl_name)
    engine.vl = vl_name
    return engine


@pytest.fixture(scope="module")
def vl_dir(vl_engine, models_dir):
    return cache_dir_for(vl_engine.vl, models_dir)


def run(engine, op):
    (result,) = engine.run_ops([op])
    if isinstance(result, Exception):
        raise result
    return result


def adapter(engine, key: str, seed: int, scale: float = 0.05):
    rt = engine.runtime(engine.vl)
    if key not in rt.pool:
        run(engine, CreateModelOp(key, engine.vl, SPEC))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, b in rt.pool.get(key).weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * scale)
    return rt.pool.get(key)


def expand(rt, before: list[int], image: bytes, after: list[int]):
    """The model input the API makes of [text, <|vision_start|>, image, <|vision_end|> + text]."""
    chunks = ChunkExpander(rt.name, rt.loaded.vision.spec, LIMITS)
    chunks.text(np.array(before + [VISION_START]))
    chunks.image(image, "png", None, "test")
    chunks.text(np.array([VISION_END] + after))
    return chunks.tokens(), chunks.image_inputs()


def peft_reference(model_dir, ad, dtype=torch.float64):
    """HF + PEFT on the whole VLM: `target_modules` for linears, `target_parameters` for experts."""
    return peft_oracle.peft_reference(model_dir, ad, dtype, auto=AutoModelForImageTextToText)


def hf_inputs(model_dir, tokens: np.ndarray, pngs: list[bytes], dtype=torch.float64) -> dict:
    """What HF's processor and forward take: pixels from the HF image processor, mm_token_type_ids."""
    processor = AutoImageProcessor.from_pretrained(model_dir)
    ids = torch.from_numpy(tokens)[None]
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if pngs:
        px = processor(images=[Image.open(io.BytesIO(p)).convert("RGB") for p in pngs], return_tensors="pt")
        out.update(pixel_values=px["pixel_values"].to(dtype), image_grid_thw=px["image_grid_thw"],
                   mm_token_type_ids=(ids == 151655).int())
    return out


def test_the_image_processor_is_the_released_configuration_and_lora_stays_off_the_tower(vl_engine):
    rt = vl_engine.runtime(vl_engine.vl)
    spec = rt.loaded.vision.spec
    assert (spec.patch_size, spec.merge_size, spec.min_pixels, spec.max_pixels) == (16, 2, 65536, 16777216)
    assert type(rt.loaded.vision.processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision
    ad = adapter(vl_engine, "vl-a", seed=1)
    assert ad.weights and all(n.startswith(("model.language_model.", "lm_head")) for n in ad.weights)
    # 100x70 is scaled up to the 64 Ki-pixel minimum: 320x224 -> 20x14 patches -> 70 tokens.
    tokens, images = expand(rt, [1, 2], striped_png(), [3])
    assert images[0].n_tokens == 70 and images[0].grid == (1, 14, 20) and len(tokens) == 3 + 70 + 2


def test_logprobs_and_lora_grads_with_images_equal_peft(vl_engine, vl_dir):
    rt = vl_engine.runtime(vl_engine.vl)
    ad = adapter(vl_engine, "vl-a", seed=1)
    reference = peft_reference(vl_dir, ad)
    rng = np.random.default_rng(2)
    pngs = [striped_png(seed=1), striped_png((48, 40), seed=2)]
    built = [expand(rt, [9707, 11], pngs[0], list(rng.integers(0, 151_000, 6))),
             expand(rt, [785], pngs[1], list(rng.integers(0, 151_000, 3)))]
    data, targets, weights = [], [], []
    for tokens, images in built:
        target = np.concatenate([tokens[1:], [13]])
        # The cookbook's shape: 0 placeholders at image positions, weight 0 there.
        w = rng.normal(size=len(tokens)).astype(np.float32)
        w[tokens == 151655] = 0.0
        target[tokens == 151655] = 0
        data.append(Datum(tokens=tokens, loss_fn_inputs={"target_tokens": target, "weights": w}, images=images))
        targets.append(target)
        weights.append(w)
    for t in ad.parameters():
        t.grad = None
    result = run(vl_engine, ForwardBackwardOp(ad.key, data, "cross_entropy"))
    assert isinstance(result, ForwardBackwardResult)
    total = torch.zeros((), dtype=torch.float64)
    for i, ((tokens, _), png) in enumerate(zip(built, pngs)):
        lp = torch.log_softmax(reference(**hf_inputs(vl_dir, tokens, [png])).logits[0], -1)
        lp = lp.gather(-1, torch.from_numpy(targets[i])[:, None])[:, 0]
        np.testing.assert_allclose(result.loss_fn_outputs[i]["logprobs"], lp.detach().numpy(), rtol=1e-5, atol=1e-5)
        total = total - (lp * torch.from_numpy(weights[i]).double()).sum()
    total.backward()
    assert result.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-5)
    assert_lora_grads_match(reference, ad)


def _forward_logprobs(engine, key, tokens, images):
    target = np.concatenate([tokens[1:], [0]])
    out = run(engine, ForwardBackwardOp(key, [Datum(tokens=tokens, loss_fn_inputs={"target_tokens": target},
                                                    images=images)], "cross_entropy", forward_only=True))
    return out.loss_fn_outputs[0]["logprobs"][:-1]


def test_two_different_images_give_different_logprobs_after_them(vl_engine):
    rt = vl_engine.runtime(vl_engine.vl)
    ad = adapter(vl_engine, "vl-a", seed=1)
    red = expand(rt, [9707], solid_png((255, 0, 0)), [1879, 374, 2518])
    blue = expand(rt, [9707], solid_png((0, 0, 255)), [1879, 374, 2518])
    assert np.array_equal(red[0], blue[0])  # the same tokens: only the pixels differ
    a, b = _forward_logprobs(vl_engine, ad.key, *red), _forward_logprobs(vl_engine, ad.key, *blue)
    n = len(red[0])
    assert np.abs(a[n - 4:] - b[n - 4:]).max() > 1e-3  # the text after the image
    # And nothing before it: bit-equal for dense models; the MoE's experts run GEMMs over the tokens
    # routed to them, whose counts the image changes, so its first position agrees to fp32 rounding.
    if "moe" in vl_engine.vl:
        np.testing.assert_allclose(a[:1], b[:1], rtol=1e-6)
    else:
        np.testing.assert_array_equal(a[:1], b[:1])


def _merged_generate(model_dir, ad, tokens, png, n: int):
    merged = peft_reference(model_dir, ad, dtype=torch.float32).merge_and_unload().eval()
    inputs = hf_inputs(model_dir, tokens, [png] if png else [], dtype=torch.float32)
    with torch.no_grad():
        out = merged.generate(**inputs, max_new_tokens=n, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=151643)
    new = out.sequences[0, len(tokens):].tolist()
    return new, np.array([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])


def test_greedy_sampling_with_an_image_equals_hf_generate_and_compute_logprobs(vl_engine, vl_dir, monkeypatch):
    """An image prompt (its M-RoPE offset carried into decode) and a text prompt decode in one batch,
    8 greedy steps each, equal to HF generate on the merged adapter; the sampled logprobs equal the
    trainer's forward of prompt + tokens with the image (what compute_logprobs runs)."""
    rt = vl_engine.runtime(vl_engine.vl)
    ad = adapter(vl_engine, "vl-a", seed=1)
    monkeypatch.setattr(sample_mod, "acquire_adapter", lambda runtime, path, max_idle: runtime.pool.acquire(path) if path else None)
    png = striped_png(seed=5)
    prompts = [expand(rt, [9707, 11], png, [1879, 374]), (np.array([785, 6722, 315, 9625, 374]), None)]
    sampler = Sampler(rt, SamplerConfig(prefill_tokens_per_step=16))
    for i, (tokens, images) in enumerate(prompts):
        sampler.admit(i, SampleOp(base_model=rt.name, adapter_path=ad.key, prompt=tokens, images=images,
                                  params=SamplingParams(max_tokens=8, temperature=0.0, stop_at_eos=False),
                                  prompt_logprobs=True))
    done = {}
    while len(done) < 2:
        done.update(dict(sampler.step()))
    for i, ((tokens, images), png_i) in enumerate(zip(prompts, [png, None])):
        want_tokens, want_lps = _merged_generate(vl_dir, ad, tokens, png_i, 8)
        (seq,) = done[i].sequences
        assert seq.tokens == want_tokens, i
        np.testing.assert_allclose(seq.logprobs, want_lps, atol=1e-4)
        full = np.concatenate([tokens, seq.tokens])
        scored = _forward_logprobs(vl_engine, ad.key, full, images)
        np.testing.assert_allclose(seq.logprobs, scored[len(tokens) - 1:], atol=1e-4)
        np.testing.assert_allclose(done[i].prompt_logprobs[1:], scored[:len(tokens) - 1], atol=1e-4)


def test_checkpoints_take_the_hosted_layout_and_older_ones_with_the_segment_still_load(vl_engine, tmp_path):
    """Saved adapter keys have no `language_model` segment (hosted Tinker's layout, which the
    cookbook's weights module expects); a checkpoint written before that, with the segment, loads
    as a new run, into an existing one (load_state) and into the sampler, with the same tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tinkerd.engine.checkpoints import WEIGHTS_FILE
    from tinkerd.types import LoadWeightsOp, SaveWeightsOp

    rt = vl_engine.runtime(vl_engine.vl)
    ad = adapter(vl_engine, "vl-a", seed=1)
    run(vl_engine, SaveWeightsOp(ad.key, str(tmp_path / "hosted"), with_optimizer=True, base_model=rt.name))
    tensors = load_file(tmp_path / "hosted" / WEIGHTS_FILE)
    assert len(tensors) >= 2 * len(ad.weights) and not [k for k in tensors if "language_model" in k]
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight" in tensors or \
        "base_model.model.model.layers.0.mlp.experts.w2.lora_A.weight" in tensors
    # As the code before the hosted layout wrote it: the modules' own names.
    shutil.copytree(tmp_path / "hosted", tmp_path / "old")
    save_file({k.replace("base_model.model.model.", "base_model.model.model.language_model."): v for k, v in tensors.items()},
              tmp_path / "old" / WEIGHTS_FILE)

    def assert_same(loaded):
        assert set(loaded.weights) == set(ad.weights)
        for n, (a, b) in ad.weights.items():
            assert torch.equal(loaded.weights[n][0], a.detach()) and torch.equal(loaded.weights[n][1], b.detach()), n

    for layout in ("hosted", "old"):
        run(vl_engine, LoadWeightsOp(f"vl-new-{layout}", rt.name, str(tmp_path / layout), with_optimizer=True))
        assert_same(rt.pool.get(f"vl-new-{layout}"))
        run(vl_engine, CreateModelOp(f"vl-into-{layout}", rt.name, SPEC))
        run(vl_engine, LoadWeightsOp(f"vl-into-{layout}", rt.name, str(tmp_path / layout), with_optimizer=True))
        assert_same(rt.pool.get(f"vl-into-{layout}"))
        sampled = sample_mod.acquire_adapter(rt, str(tmp_path / layout), max_idle=8)
        assert_same(sampled)
        rt.pool.release(sampled)
