"""Images through a live `tinkerd serve` and the unmodified SDK and cookbook (issue 22 item 3).

The base model is the tiny Qwen3-VL (engine/model/tiny.py), served from its built directory so the
cookbook finds its tokenizer and `preprocessor_config.json` by name (`get_image_processor` is
`AutoImageProcessor.from_pretrained(model_name)`). Inputs are made the cookbook's way: the
`qwen3_vl_instruct` renderer turns an image into `<|vision_start|>`, an ImageChunk (JPEG, with
`expected_tokens` from the processor) and `<|vision_end|>`; forward_backward sends it as protobuf,
sample / compute_logprobs as base64 JSON. A text-only model beside it refuses images. The cookbook's
`recipes/vlm_classifier` runs on the tiny Qwen3.5 VLM served beside them, with its own renderer.
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
import struct
import zlib

import datasets
import numpy as np
import pytest
import tinker
from PIL import Image
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.image_processing_utils import get_image_processor
from tinker_cookbook.supervised.common import datum_from_model_input_weights
from transformers import AutoTokenizer

from tests.serverproc import API_KEY, start_server
from tinkerd.engine.model import tiny
from tinkerd.engine.model.registry import _build_once

VL = "tinkerd/tiny-qwen3-vl"
VL35 = "tinkerd/tiny-qwen3.5-vl"
TEXT = "tinkerd/tiny-qwen3"
RENDERER = "qwen3_vl_instruct"
COLOURS = {"red": (230, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 230)}


@pytest.fixture(scope="module")
def vl_dir(models_dir):
    # Served by its absolute path: the cookbook loads tokenizer and image processor by model name.
    return str(_build_once(VL, models_dir, tiny.build_tiny))


@pytest.fixture(scope="module")
def vl35_dir(models_dir):
    return str(_build_once(VL35, models_dir, tiny.build_tiny))


@pytest.fixture(scope="module")
def server(tmp_path_factory, vl_dir, vl35_dir):
    srv = start_server(tmp_path_factory.mktemp("tinkerd-vlm"), [vl_dir, vl35_dir, TEXT], ["--threads", "2"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sc(server):
    return tinker.ServiceClient(base_url=server.url, api_key=API_KEY)


@pytest.fixture(scope="module")
def renderer(vl_dir):
    return renderers.get_renderer(RENDERER, AutoTokenizer.from_pretrained(vl_dir), image_processor=get_image_processor(vl_dir))


def solid(colour: str, size=(40, 30)) -> Image.Image:
    return Image.fromarray(np.full((size[1], size[0], 3), COLOURS[colour], dtype=np.uint8))


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def example(renderer, colour: str) -> types.Datum:
    messages = [
        renderers.Message(role="user", content=[renderers.ImagePart(type="image", image=solid(colour)),
                                                renderers.TextPart(type="text", text="What colour is this?")]),
        renderers.Message(role="assistant", content=f"It is {colour}."),
    ]
    return datum_from_model_input_weights(*renderer.build_supervised_example(messages), max_length=4096)


def prompt_of(renderer, colour: str) -> types.ModelInput:
    messages = [renderers.Message(role="user", content=[renderers.ImagePart(type="image", image=solid(colour)),
                                                        renderers.TextPart(type="text", text="What colour is this?")])]
    return renderer.build_generation_prompt(messages)


def test_an_sl_loop_with_images_learns_and_samples_what_compute_logprobs_scores(sc, vl_dir, renderer):
    tc = sc.create_lora_training_client(base_model=vl_dir, rank=8, seed=2).result()
    data = [example(renderer, c) for c in COLOURS]
    # As the cookbook sends it: <|vision_start|> and <|vision_end|> as text chunks of their own.
    (image,) = [c for c in data[0].model_input.chunks if c.type == "image"]
    assert image.format == "jpeg" and image.expected_tokens == 70  # 40x30 -> 320x224 at the 64 Ki minimum
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 0.6 * losses[0], losses
    # Per-position logprobs cover the image positions too: target and output lengths agree.
    assert len(fb.result().loss_fn_outputs[0]["logprobs"].tolist()) == data[0].model_input.length

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = prompt_of(renderer, "green")
    res = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result()
    seq = res.sequences[0]
    full = types.ModelInput(chunks=[*prompt.chunks, types.EncodedTextChunk(tokens=seq.tokens)])
    scored = sampler.compute_logprobs(full).result()
    assert len(scored) == prompt.length + len(seq.tokens)
    np.testing.assert_allclose(seq.logprobs, scored[-len(seq.tokens):], atol=1e-4)
    # Different images give different logprobs after them, not before.
    red = sampler.compute_logprobs(types.ModelInput(chunks=[*prompt_of(renderer, "red").chunks,
                                                            types.EncodedTextChunk(tokens=seq.tokens)])).result()
    assert max(abs(a - b) for a, b in zip(red[-len(seq.tokens):], scored[-len(seq.tokens):])) > 1e-3
    assert red[1] == scored[1]


def _hostile_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its pixels would never fit): signature, IHDR, an
    empty IDAT and IEND. Refused from the header, before a byte is decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_bad_images_are_user_errors_and_the_server_carries_on(sc, vl_dir, renderer):
    tc = sc.create_lora_training_client(base_model=vl_dir, rank=4, seed=3).result()
    sampler = sc.create_sampling_client(base_model=vl_dir).result()
    good = _png(solid("red"))
    bad = {
        "truncated": (types.ImageChunk(data=good[: len(good) // 2], format="png"), "truncated or corrupt"),
        "format": (types.ImageChunk(data=good, format="jpeg"), "format 'jpeg' but the data is a PNG"),
        "expected": (types.ImageChunk(data=good, format="png", expected_tokens=69), "Expected 69 tokens, got 70 from image"),
        "oversized": (types.ImageChunk(data=_hostile_png(10_000, 10_000), format="png"), "100000000 pixels"),
    }
    for name, (chunk, message) in bad.items():
        model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), chunk,
                                               types.EncodedTextChunk(tokens=[3])])
        n = 3 + (chunk.expected_tokens or 70)
        datum = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [0] * n, "weights": [0.0] * n})
        with pytest.raises(tinker.BadRequestError, match=message):
            tc.forward_backward([datum], "cross_entropy").result()  # protobuf
        with pytest.raises(tinker.BadRequestError, match=message):
            sampler.sample(model_input, 1, types.SamplingParams(max_tokens=2)).result()  # JSON, base64
    pointer = types.ModelInput(chunks=[types.ImageAssetPointerChunk(format="png", location="/etc/passwd", expected_tokens=4)])
    with pytest.raises(tinker.BadRequestError, match="image_asset_pointer chunks are not supported"):
        sampler.sample(pointer, 1, types.SamplingParams(max_tokens=2)).result()
    # A text-only base model refuses images by name.
    text_sampler = sc.create_sampling_client(base_model=TEXT).result()
    with pytest.raises(tinker.BadRequestError, match="text-only"):
        text_sampler.sample(prompt_of(renderer, "red"), 1, types.SamplingParams(max_tokens=2)).result()
    # And the server carries on: the same clients train and sample with a good image.
    assert tc.forward_backward([example(renderer, "blue")], "cross_entropy").result().metrics["loss:sum"] > 0
    assert len(sampler.sample(prompt_of(renderer, "blue"), 1, types.SamplingParams(max_tokens=2)).result().sequences) == 1


def test_the_image_placeholder_inside_text_is_a_400_naming_it(sc, vl_dir, renderer):
    """Token 151655 (<|image_pad|>, the model's image_token_id) in a text chunk, with an image beside
    it or none, is refused by the API on both wire forms, naming the position; a text-only model
    takes it as any other token."""
    tc = sc.create_lora_training_client(base_model=vl_dir, rank=4, seed=5).result()
    sampler = sc.create_sampling_client(base_model=vl_dir).result()
    image = types.ImageChunk(data=_png(solid("red")), format="png", expected_tokens=70)
    inputs = {
        "beside an image": (types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), image,
                                                     types.EncodedTextChunk(tokens=[3, 151655])]), 73),
        "text only": (types.ModelInput.from_ints([1, 151655, 2]), 1),
    }
    for name, (model_input, at) in inputs.items():
        n = model_input.length
        datum = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [0] * n, "weights": [0.0] * n})
        message = f"text holds token 151655, the model's image placeholder, at position {at}"
        with pytest.raises(tinker.BadRequestError, match=f"datum 0: {message}"):
            tc.forward_backward([datum], "cross_entropy").result()  # protobuf
        with pytest.raises(tinker.BadRequestError, match=f"prompt: {message}"):
            sampler.sample(model_input, 1, types.SamplingParams(max_tokens=2)).result()  # JSON
    text_model = sc.create_sampling_client(base_model=TEXT).result()
    assert len(text_model.compute_logprobs(types.ModelInput.from_ints([1, 151655, 2])).result()) == 3


def _colour_dataset(per_class: int, height: int) -> datasets.Dataset:
    names = list(COLOURS)
    rows = [(solid(c, (48 + 8 * i, height)), names.index(c)) for i in range(per_class) for c in names]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    return datasets.Dataset.from_dict({"image": [r[0] for r in rows], "label": [r[1] for r in rows]}, features=features)


@pytest.mark.slow  # the call: 95 s at load average 5 on 2 shared cores, 270-670 s at 10-15
def test_the_cookbooks_vlm_classifier_recipe_learns_the_colours_through_tinkerd(server, vl35_dir, tmp_path, monkeypatch):
    """`recipes/vlm_classifier` unmodified, on the tiny Qwen3.5 VLM with the recipe's own renderer
    (`qwen3_5_disable_thinking`) and its defaults for rank (32) and schedule (cosine); only the
    dataset download is replaced, by solid-colour images made here: 3 classes, 4 train images each,
    2 test images each at another height (so other image-token counts). Each class name is one token
    of the tokenizer, so the target after the evaluator's prefill "The subject in this photo is:"
    is one label token and <|im_end|>.

    12 steps (4 epochs of 3 batches of 4) at lr 1e-2: the evaluator samples (greedy, the image in
    the prompt) before step 0 and before step 11. Chance is 1/3; the bound is twice that.
    Untrained, the model's answer is not a class name at all (accuracy 0.0).

    Why the earlier setup stayed at 0.0: rank 8 at lr 3e-2 for 6 steps (or rank 32 at 5e-2, 32
    steps, unstable) never learned the fixed answer phrase, so the evaluator parsed words like
    "subject subject"; at rank 8 and lr 2e-2 the phrase is learned after ~40 steps but the answer
    is the same colour for every image (logprob -0.8 for each) by step 75."""
    from tinker_cookbook.recipes.vlm_classifier import train as recipe

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    # What can be seeded: the adapter's A through the SDK's own `seed` (the recipe passes none) and
    # the recipe's horizontal flips (the global `random`); sampling is greedy.
    create = tinker.ServiceClient.create_lora_training_client
    monkeypatch.setattr(tinker.ServiceClient, "create_lora_training_client",
                        lambda self, *a, **k: create(self, *a, **{"seed": 5, **k}))
    monkeypatch.setattr(random, "random", random.Random(0).random)
    splits = datasets.DatasetDict({"train": _colour_dataset(4, 40), "test": _colour_dataset(2, 36)})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: splits)
    config = recipe.ExperimentConfig(
        experiment_dir=str(tmp_path), dataset="caltech101", model_name=vl35_dir,
        base_url=server.url, behavior_if_log_dir_exists="delete", learning_rate=1e-2, num_epochs=4,
        batch_size=4, save_every=1000, eval_every=11, infrequent_eval_every=1000, n_eval=6,
        max_tokens=8, run_nll_evaluator=False)
    assert (config.renderer_name, config.lora_rank, config.lr_schedule) == ("qwen3_5_disable_thinking", 32, "cosine")
    recipe.run_experiment(config)
    (metrics_file,) = tmp_path.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    accuracy = {r["step"]: r["accuracy"] for r in rows if "accuracy" in r}
    print("vlm_classifier train NLL", nll, "accuracy", accuracy)
    assert len(nll) == 12 and set(accuracy) == {0, 11}, rows
    chance = 1 / len(COLOURS)
    assert accuracy[0] <= chance and accuracy[11] >= 2 * chance, accuracy
    # Each datum has 9 target tokens, one of them the label: a model blind to the image scores at
    # best log(3) on it, log(3) / 9 per token on average. The trained one is below that.
    assert nll[-1] < math.log(len(COLOURS)) / 9 < nll[0], nll
