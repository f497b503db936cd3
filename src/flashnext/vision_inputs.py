"""Images -> model inputs (`pixel_values`, `image_grid_thw`) and the prompt's placeholder tokens.

Resizing, rescaling, normalising and patchifying are transformers' image processor registered for `qwen4_exp`
(`Qwen2VLImageProcessorPil`); this module only decodes the image source, configures the processor from the
vision config and builds the placeholder span. transformers and Pillow are optional dependencies, imported on
first use (`pip install transformers pillow`).

The processor emits each image's patches in merge-block order, which is what `flashnext.model.vision` expects.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashnext.config import VisionConfig
from flashnext.errors import InputError

# The processor's pixel budget (its defaults): at least 56*56 and at most 28*28*1280 pixels per image.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


@dataclass
class ImageInputs:
    """pixel_values: float [sum t*h*w, P]; image_grid_thw: int64 [n, 3]; num_tokens: placeholders per image."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    num_tokens: list[int]


def _require(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"image inputs need the optional dependency {package!r}: pip install transformers pillow"
        ) from e


def load_image(source: Any):
    """A PIL image from a PIL image (returned as is), raw bytes, or a `data:image/...;base64,...` URL.

    Raises:
        InputError: a remote (`http(s)://`) URL (there is no network to fetch it), or an undecodable source.
    """
    pil = _require("PIL.Image", "pillow")
    if isinstance(source, pil.Image):
        return source
    if isinstance(source, str):
        if source.startswith(("http://", "https://")):
            raise InputError(f"remote image URLs are not supported (no network); send a data URL: {source[:80]!r}")
        if not source.startswith("data:"):
            raise InputError(f"image source must be a data: URL, bytes or a PIL image, got {source[:40]!r}")
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise InputError(f"data URL must be base64-encoded, got header {header!r}")
        try:
            source = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise InputError(f"data URL payload is not valid base64 ({e})") from e
    if isinstance(source, bytes | bytearray):
        try:
            image = pil.open(io.BytesIO(source))
            image.load()
        except Exception as e:  # Pillow raises several error types for corrupt data
            raise InputError(f"cannot decode image ({type(e).__name__}: {e})") from e
        return image
    raise InputError(f"image source must be a data: URL, bytes or a PIL image, got {type(source).__name__}")


def image_processor(
    vision: VisionConfig,
    path: str | Path | None = None,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
):
    """transformers' `Qwen2VLImageProcessorPil` with the tower's patch geometry.

    Args:
        vision: the model's vision config (patch, temporal patch and merge sizes come from it).
        path: a checkpoint directory with `preprocessor_config.json` (its normalisation and pixel budget win),
            or None for the processor's defaults with `min_pixels` / `max_pixels`.
    """
    _require("PIL.Image", "pillow")
    mod = _require("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", "transformers")
    geometry = dict(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
    )
    if path is not None and (Path(path) / "preprocessor_config.json").is_file():
        return mod.Qwen2VLImageProcessorPil.from_pretrained(path, **geometry)
    return mod.Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **geometry)


def process_images(images: list[Any], vision: VisionConfig, processor=None) -> ImageInputs:
    """PIL images / data URLs / bytes -> `ImageInputs` (the order of `images` is the order in the prompt)."""
    processor = processor or image_processor(vision)
    out = processor(images=[load_image(x) for x in images], return_tensors="pt")
    grid = out["image_grid_thw"].long()
    m2 = vision.spatial_merge_size**2
    return ImageInputs(out["pixel_values"], grid, [int(n) // m2 for n in grid.prod(-1).tolist()])


def image_span(num_tokens: int, image_token_id: int, vision_start_token_id: int, vision_end_token_id: int):
    """The token ids one image occupies in a prompt: start, `num_tokens` placeholders, end."""
    return [vision_start_token_id, *([image_token_id] * num_tokens), vision_end_token_id]
