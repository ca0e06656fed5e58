"""Image chunks in, before any op is queued: checked, counted and expanded into placeholder positions.

The SDK's `ImageChunk` carries encoded PNG or JPEG bytes (`format`), and optionally the number of
tokens the client expects (`expected_tokens`, "advisory: ... we can fail requests quickly if the
tokens does not match"). The cookbook's renderers send no placeholder tokens: the server turns each
image into N positions of the model's `image_token_id` itself, so the client's loss targets (N zero
placeholders, weight 0) line up only if N is exactly what the client computed. N comes from the
Qwen-VL image processor's resize rule (`smart_resize`: each side rounded to patch x merge pixels,
the area clamped to the model's min/max pixels) on the image's size: a grid of patch x patch
patches, merged merge x merge into one token each.

Shared by the api (which counts and refuses) and the engine (which decodes again and runs the
model's own processor, checking it made the same grid), so it imports no torch or transformers;
`smart_resize` is pinned against transformers' own in tests/unit/test_images.py.

Bounds, so a hostile image is a `user` error and never an allocation: the bytes of all images of
one request (`ImageLimits.max_bytes`), and each image's width x height, read from its header before
a pixel is decoded (`ImageLimits.max_pixels`; a 100-megapixel PNG would take 300 MB as RGB).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from tinkerd.errors import UserError
from tinkerd.types import ImageInput, VisionSpec

# The ImageChunk `format` values and the PIL format names of the bytes they must be.
FORMATS = {"png": "PNG", "jpeg": "JPEG"}
# transformers' smart_resize refuses images more elongated than this (ValueError).
_MAX_ASPECT = 200


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int  # encoded bytes of all the images of one request
    max_pixels: int  # width x height of one image, checked before it is decoded


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size the Qwen-VL image processors resize to (transformers' `smart_resize`, the same
    arithmetic: each side a multiple of `factor`, the area within [min_pixels, max_pixels])."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_of(spec: VisionSpec, width: int, height: int) -> tuple[tuple[int, int, int], int]:
    """(t, h, w) patches of an image of this size, and its number of tokens (h * w / merge^2)."""
    h, w = smart_resize(height, width, spec.patch_size * spec.merge_size, spec.min_pixels, spec.max_pixels)
    gh, gw = h // spec.patch_size, w // spec.patch_size
    return (1, gh, gw), gh * gw // (spec.merge_size**2)


def open_image(data: bytes, fmt: str, limits: ImageLimits, where: str) -> Image.Image:
    """The image, fully decoded, or a UserError naming what is wrong with it."""
    if fmt not in FORMATS:
        raise UserError(f"{where}: image format {fmt!r} is not supported (png or jpeg)")
    if not data:
        raise UserError(f"{where}: the image has no data")
    try:
        with warnings.catch_warnings():
            # PIL warns from 89 M pixels and refuses from twice that; our own bound comes next.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise UserError(f"{where}: the image is too large to decode ({e}); the server's limit is "
                        f"{limits.max_pixels} pixels per image") from e
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{where}: the image data is not a readable {fmt.upper()} image ({e})") from e
    if image.format != FORMATS[fmt]:
        raise UserError(f"{where}: the chunk says format {fmt!r} but the data is a {image.format} image")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise UserError(f"{where}: the image is {width}x{height} = {width * height} pixels, more than the server's "
                        f"limit of {limits.max_pixels} per image; scale it down")
    if min(width, height) < 1 or max(width, height) / min(width, height) > _MAX_ASPECT:
        raise UserError(f"{where}: the image is {width}x{height}; its aspect ratio must be below {_MAX_ASPECT}")
    try:
        image.load()  # a truncated file fails here, not in the engine
    except (OSError, ValueError, SyntaxError) as e:
        raise UserError(f"{where}: the {fmt.upper()} image data is truncated or corrupt ({e})") from e
    return image


def refuse_text_placeholders(tokens: np.ndarray, images: list[ImageInput] | None, vision: VisionSpec | None,
                             where: str) -> None:
    """A UserError when the model's image placeholder id appears outside the images' own positions:
    a text chunk holding it would take the place of an image's features (the engine refuses a datum
    whose placeholders and images disagree), or, with no image at all, train on an embedding that only
    ever stands for the tower's output."""
    if vision is None:
        return
    stray = tokens == vision.image_token_id
    for im in images or []:
        stray[im.offset:im.offset + im.n_tokens] = False
    if stray.any():
        at = np.flatnonzero(stray)
        raise UserError(f"{where}: text holds token {vision.image_token_id}, the model's image placeholder, at "
                        f"position {int(at[0])}{f' (and {len(at) - 1} more)' if len(at) > 1 else ''}; it is "
                        "reserved for the positions of image chunks: send the image as an ImageChunk")


class ChunkExpander:
    """Builds one model input from its chunks in order: text tokens as they are, each image as its
    placeholder positions (and an ImageInput); `vision` None refuses images (a text-only model)."""

    def __init__(self, model: str, vision: VisionSpec | None, limits: ImageLimits, budget: list[int] | None = None):
        self.model, self.vision, self.limits = model, vision, limits
        # Image bytes left for the whole request, shared by its datums' expanders.
        self.budget = budget if budget is not None else [limits.max_bytes]
        self.parts: list[np.ndarray] = []
        self.images: list[ImageInput] = []
        self.length = 0

    def text(self, tokens: np.ndarray) -> None:
        self.parts.append(tokens.astype(np.int64, copy=False))
        self.length += len(tokens)

    def image(self, data: bytes, fmt: str, expected_tokens: int | None, where: str) -> None:
        if self.vision is None:
            raise UserError(f"{where}: image chunks are not supported by base model {self.model!r}: it is served as a "
                            "text-only model")
        self.budget[0] -= len(data)
        if self.budget[0] < 0:
            raise UserError(f"{where}: the request's images exceed the server's limit of {self.limits.max_bytes} bytes "
                            "of image data per request")
        image = open_image(data, fmt, self.limits, where)
        grid, n = grid_of(self.vision, *image.size)
        if expected_tokens is not None and expected_tokens != n:
            raise UserError(f"Expected {expected_tokens} tokens, got {n} from image")
        self.images.append(ImageInput(self.length, n, fmt, np.frombuffer(data, dtype=np.uint8).copy(), grid))
        self.parts.append(np.full(n, self.vision.image_token_id, dtype=np.int64))
        self.length += n

    def tokens(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int64)

    def image_inputs(self) -> list[ImageInput] | None:
        return self.images or None
