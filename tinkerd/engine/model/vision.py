"""Images into a vision-language model (Qwen3-VL): pixels, placeholder embeddings and M-RoPE positions.

The API expanded every ImageChunk into N `image_token_id` positions (tinkerd/images.py), counting N
with the processor's resize rule. Here the image is decoded again and run through the model's own
image processor, configured from the model's `preprocessor_config.json` (`AutoImageProcessor`, PIL
backend: `Qwen2VLImageProcessorPil`, no torchvision), which must give the grid the API counted.

Positions: Qwen3-VL rotates with M-RoPE, three position ids (time, height, width) per token. Text
advances all three by one; an image's tokens take their patch coordinates and advance the text
after them by max(h, w) / merge, not by N, so a row's last position is `length - 1 + delta` with a
negative `delta` per image (`get_rope_index`'s mrope_position_deltas). The model's own forward
keeps that delta on the module (`rope_deltas`) between calls, which is per-process state that two
tenants would overwrite; tinkerd computes positions itself with the stateless `get_rope_index` and
passes them in, and the sampler keeps each row's delta for decode (HF's generate does the same:
decode positions are `cache length + rope_deltas` on all three axes).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor

from tinkerd.errors import ServerError, UserError
from tinkerd.images import ImageLimits, open_image
from tinkerd.types import ImageInput, VisionSpec

# The API bounded bytes and pixels before the op was accepted; a replayed op is decoded again
# under these (which only the API's limits ever reach).
_REPLAY = ImageLimits(max_bytes=1 << 62, max_pixels=1 << 62)


class Vision:
    """One VLM base model's image path: its processor and its placeholder / position rules."""

    def __init__(self, model: torch.nn.Module, model_dir: str | Path):
        cfg = model.config
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            raise UserError(f"the vision-language model in {model_dir} has no usable preprocessor_config.json "
                            f"({e}); its image token count cannot be known") from e
        p = self.processor
        vision = cfg.vision_config
        if (p.patch_size, p.merge_size, p.temporal_patch_size) != (
                vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise UserError(f"{model_dir}: preprocessor_config.json patches {p.patch_size}/{p.merge_size}/"
                            f"{p.temporal_patch_size} disagree with the vision config's {vision.patch_size}/"
                            f"{vision.spatial_merge_size}/{vision.temporal_patch_size}")
        self.spec = VisionSpec(image_token_id=int(cfg.image_token_id), patch_size=int(p.patch_size),
                               merge_size=int(p.merge_size), temporal_patch_size=int(p.temporal_patch_size),
                               min_pixels=int(p.size["shortest_edge"]), max_pixels=int(p.size["longest_edge"]))
        self.model = model

    def pixels(self, images: list[ImageInput], device: torch.device, dtype: torch.dtype):
        """pixel_values [patches, C*T*P*P] and image_grid_thw [n, 3] of `images`, in order."""
        pil = [open_image(bytes(im.data), im.format, _REPLAY, f"image {i}").convert("RGB") for i, im in enumerate(images)]
        out = self.processor(images=pil, return_tensors="pt")
        grids = out["image_grid_thw"]
        for im, grid in zip(images, grids.tolist()):
            if tuple(grid) != tuple(im.grid):  # the API's count and the processor disagree: a bug
                raise ServerError(f"image processor made grid {grid}, the request was counted as {list(im.grid)}")
        return out["pixel_values"].to(device, dtype), grids.to(device)

    def inputs(self, input_ids: torch.Tensor, mask: torch.Tensor | None, rows: list[list[ImageInput] | None]) -> dict:
        """Keyword arguments for the VLM body (`model.model`) on a right-padded batch whose row b holds
        the images rows[b]: pixel_values, image_grid_thw, mm_token_type_ids and explicit M-RoPE
        position_ids [3, B, T]; plus `rope_deltas` [B] (not a model argument: the sampler's)."""
        images = [im for row in rows for im in (row or [])]
        mm = (input_ids == self.spec.image_token_id).to(torch.int32)  # 1 image, 0 text
        for b, row in enumerate(rows):
            want = sum(im.n_tokens for im in row or [])
            if int(mm[b].sum()) != want:
                raise UserError(f"row {b}: {int(mm[b].sum())} image placeholder tokens for {want} image positions; "
                                f"token {self.spec.image_token_id} is reserved for images")
        dtype = next(self.model.parameters()).dtype
        pixel_values, grid = self.pixels(images, input_ids.device, dtype)
        positions, deltas = self.model.model.get_rope_index(
            input_ids, mm_token_type_ids=mm, image_grid_thw=grid, attention_mask=mask)
        return {"pixel_values": pixel_values, "image_grid_thw": grid, "mm_token_type_ids": mm,
                "position_ids": positions, "rope_deltas": deltas.view(-1)}


def tiny_processor_files(out_dir: Path, patch: int, merge: int, temporal: int) -> None:
    """preprocessor_config.json of the released Qwen3-VL / Qwen3.5 checkpoints, for a tiny model:
    patch 16, merge 2, 64 Ki to 16 Mi pixels, mean and std 0.5 (not the processor class defaults,
    which are Qwen2-VL's: patch 14, 56x56 to 28x28x1280 pixels, CLIP's mean and std)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(patch_size=patch, merge_size=merge, temporal_patch_size=temporal,
                             size={"shortest_edge": 64 * 1024, "longest_edge": 16 * 1024 * 1024},
                             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]).save_pretrained(out_dir)


def solid_png(rgb: tuple[int, int, int], size: tuple[int, int] = (32, 32)) -> bytes:
    """A one-colour PNG (tests and examples)."""
    buf = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), rgb, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()
