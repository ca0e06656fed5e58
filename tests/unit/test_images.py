"""tinkerd/images.py: image chunks counted as the model's own processor counts them, and bad images
refused as user errors before anything is decoded or queued."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from tinkerd import images
from tinkerd.errors import UserError
from tinkerd.types import VisionSpec

# The released Qwen3-VL / Qwen3.5 processor configuration (engine/model/vision.py).
SPEC = VisionSpec(image_token_id=151655, patch_size=16, merge_size=2, temporal_patch_size=2,
                  min_pixels=65536, max_pixels=16777216)
LIMITS = images.ImageLimits(max_bytes=1 << 20, max_pixels=1 << 24)
SIZES = [(1, 1), (30, 40), (100, 70), (480, 360), (257, 129), (1000, 10), (4097, 4095), (6000, 5000), (31, 6000)]


def _encoded(size, fmt="PNG") -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(size[0])
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("width, height", SIZES)
def test_smart_resize_is_transformers_own(width, height):
    assert images.smart_resize(height, width, 32, SPEC.min_pixels, SPEC.max_pixels) == smart_resize(
        height, width, 32, min_pixels=SPEC.min_pixels, max_pixels=SPEC.max_pixels)


def test_the_count_is_the_processors_grid():
    processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                         size={"shortest_edge": SPEC.min_pixels, "longest_edge": SPEC.max_pixels})
    for width, height in [(30, 40), (100, 70), (480, 360), (257, 129)]:
        image = Image.new("RGB", (width, height))
        grid = processor(images=[image], return_tensors="np")["image_grid_thw"][0].tolist()
        (t, h, w), n = images.grid_of(SPEC, width, height)
        assert [t, h, w] == grid and n == h * w // 4
        # And what the cookbook computes for expected_tokens (renderers/base.py: image_to_chunk).
        assert n == processor.get_number_of_image_patches(height, width) // 4


def test_an_image_expands_to_its_placeholders_between_text():
    chunks = images.ChunkExpander("m", SPEC, LIMITS)
    chunks.text(np.array([1, 2]))
    data = _encoded((100, 70))
    chunks.image(data, "png", 70, "chunk 1")
    chunks.text(np.array([3]))
    tokens = chunks.tokens()
    assert tokens.tolist() == [1, 2] + [151655] * 70 + [3]
    (img,) = chunks.image_inputs()
    assert (img.offset, img.n_tokens, img.grid, img.format) == (2, 70, (1, 14, 20), "png")
    assert img.data.tobytes() == data


def _header_only_png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.mark.parametrize("data, fmt, expected, message", [
    (_encoded((100, 70))[:300], "png", None, "truncated or corrupt"),
    (b"not an image at all", "png", None, "not a readable PNG"),
    (_encoded((100, 70)), "jpeg", None, "format 'jpeg' but the data is a PNG"),
    (_encoded((100, 70), "JPEG"), "png", None, "format 'png' but the data is a JPEG"),
    (_encoded((100, 70)), "gif", None, "format 'gif' is not supported"),
    (_encoded((100, 70)), "png", 71, "Expected 71 tokens, got 70 from image"),
    (_header_only_png(10_000, 10_000), "png", None, "10000x10000 = 100000000 pixels"),
    (_header_only_png(20_000, 20_000), "png", None, "too large to decode"),  # PIL's own bomb guard, first
    (_encoded((1000, 4)), "png", None, "aspect ratio"),
    (b"", "png", None, "no data"),
])
def test_bad_images_are_user_errors(data, fmt, expected, message):
    with pytest.raises(UserError, match=message):
        images.ChunkExpander("m", SPEC, LIMITS).image(data, fmt, expected, "chunk 0")


def test_a_text_only_model_refuses_images_and_the_byte_budget_spans_the_request():
    with pytest.raises(UserError, match="image chunks are not supported by base model 'm'"):
        images.ChunkExpander("m", None, LIMITS).image(_encoded((100, 70)), "png", None, "chunk 0")
    data = _encoded((100, 70))
    budget = [len(data) * 2 - 1]  # room for one image and most of a second
    images.ChunkExpander("m", SPEC, LIMITS, budget).image(data, "png", None, "datum 0")
    with pytest.raises(UserError, match="bytes of image data per request"):
        images.ChunkExpander("m", SPEC, LIMITS, budget).image(data, "png", None, "datum 1")


def test_an_image_op_survives_the_op_log_bit_exact():
    """Recovery replays ops from their stored records alone: the image bytes and grid come back."""
    from tinkerd.control import oplog
    from tinkerd.types import Datum, ForwardBackwardOp

    chunks = images.ChunkExpander("m", SPEC, LIMITS)
    chunks.text(np.array([1, 2]))
    chunks.image(_encoded((100, 70)), "png", None, "chunk 1")
    tokens = chunks.tokens()
    op = ForwardBackwardOp("run", [Datum(tokens=tokens, loss_fn_inputs={"target_tokens": tokens},
                                         images=chunks.image_inputs())], "cross_entropy")
    back = oplog.loads(oplog.dumps(op))
    (img,), (want,) = back.data[0].images, op.data[0].images
    assert img.data.tobytes() == want.data.tobytes() and img.grid == want.grid and img.offset == want.offset
