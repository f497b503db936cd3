"""Image rows of an SFT dataset: chat messages whose content parts reference images (for a composite model).

A row is a `{"messages": [...]}` line whose user/system turns may hold a list of content parts:
`{"type": "text", "text": str}`, `{"type": "image", "image": SOURCE}` or OpenAI's
`{"type": "image_url", "image_url": {"url": SOURCE}}`, where SOURCE is a local path (relative to the JSONL file's
directory, or absolute) or a `data:image/...;base64,...` URL. Assistant turns stay text (the loss is on them).

The conversation is rendered by the tokenizer's chat template as text, with a sentinel standing for each image; the
text is cut at every sentinel and at every assistant turn's boundaries (found, as for text rows, by rendering
prefixes), each piece is tokenized on its own (as the server tokenizes an image prompt: between its images), and
each sentinel becomes the image's placeholder span `vision_start, image x n, vision_end`. The images go through
the vision tower's processor (`flashnext.vision_inputs`); the row keeps its pixels, grid and 3-D MRoPE positions
(`model.multimodal.get_rope_index`), so `packing.collate` packs it with text rows (whose positions are the same on
the three axes).

Bad rows (`InputError`, reported with file and line by `data.load_jsonl`): an image file that is missing or cannot
be read, an undecodable image, an image in an assistant turn, images for a model without a vision tower, and a row
whose tokens (its image placeholders included) exceed the sequence budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashnext.errors import InputError

SENTINEL = "\ue000"  # a private-use character: no template or text of a row holds it
IMAGE_PARTS = ("image", "image_url")


@dataclass(frozen=True)
class RowImages:
    """The images of one example: pixels [sum t*h*w, P], grids int64 [n, 3], positions int64 [3, len],
    token types int64 [len] (1 on image placeholders)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    position_ids: torch.Tensor
    mm_token_type_ids: torch.Tensor


@dataclass
class ImageRows:
    """What image rows need: the composite model's config, the data file's directory, the sequence budget, and the
    processor's pixel budget per image (None: the processor's defaults)."""

    model_config: Any
    base_dir: Path
    max_tokens: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    _processor: Any = field(default=None, repr=False)

    def processor(self):
        if self._processor is None:
            from flashnext.vision_inputs import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, image_processor

            lo, hi = self.min_pixels or DEFAULT_MIN_PIXELS, self.max_pixels or DEFAULT_MAX_PIXELS
            self._processor = image_processor(self.model_config.vision_config, min_pixels=lo, max_pixels=hi)
        return self._processor


def has_images(messages: Any) -> bool:
    """Whether a `messages` value holds any image content part."""
    return isinstance(messages, list) and any(
        isinstance(m, Mapping) and isinstance(m.get("content"), list)
        and any(isinstance(p, Mapping) and p.get("type") in IMAGE_PARTS for p in m["content"])
        for m in messages
    )  # fmt: skip


def image_messages(messages: list, tokenizer: Any, rows: ImageRows | None, ignore: int = -100):
    """One image row -> (input ids, labels (`ignore` off the answers), its `RowImages`) for `train.data`'s
    `Example` (see the module docstring); `InputError` if bad."""
    if rows is None or getattr(rows.model_config, "vision_config", None) is None:
        raise InputError("the row has image content parts but the model has no vision tower (a text model)")
    texts, sources = _flatten(messages)
    images = [_read(src, rows.base_dir) for src in sources]
    from flashnext.vision_inputs import image_span, process_images

    cfg = rows.model_config
    inputs = process_images(images, cfg.vision_config, rows.processor())
    full = tokenizer.apply_chat_template(texts, add_generation_prompt=False, tokenize=False)
    cuts, labelled = {0, len(full)}, []
    for i, m in enumerate(texts):
        if m["role"] != "assistant":
            continue
        start = tokenizer.apply_chat_template(texts[:i], add_generation_prompt=True, tokenize=False) if i else ""
        end = tokenizer.apply_chat_template(texts[: i + 1], add_generation_prompt=False, tokenize=False)
        if not full.startswith(end) or not end.startswith(start):
            raise InputError(f"chat template is not prefix-stable at messages[{i}]")
        cuts |= {len(start), len(end)}
        labelled.append((len(start), len(end)))
    at = [i for i, ch in enumerate(full) if ch == SENTINEL]
    if len(at) != len(images):
        raise InputError(f"{len(images)} images but {len(at)} image positions in the rendered chat template")
    cuts |= set(at) | {i + 1 for i in at}
    ids: list[int] = []
    labels: list[int] = []
    spans = iter(inputs.num_tokens)
    bounds = sorted(cuts)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if full[a:b] == SENTINEL:
            piece = image_span(next(spans), cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
            ids += piece
            labels += [ignore] * len(piece)
            continue
        piece = list(tokenizer.encode(full[a:b]))
        ids += piece
        labels += piece if any(s <= a and b <= e for s, e in labelled) else [ignore] * len(piece)
    if rows.max_tokens is not None and len(ids) > rows.max_tokens:
        raise InputError(
            f"the row has {len(ids)} tokens ({sum(inputs.num_tokens)} image placeholders) > token_budget="
            f"{rows.max_tokens}: too many image tokens for the sequence (lower data.image_max_pixels or raise "
            "data.token_budget)"
        )
    return ids, labels, _row_images(ids, inputs, cfg)


def _flatten(messages: list) -> tuple[list[dict], list[str]]:
    """(messages with string contents, a sentinel per image; the image sources in order)."""
    texts, sources = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InputError(f"messages[{i}] must be an object with a string 'role', got {str(m)[:80]}")
        content = m.get("content")
        if isinstance(content, str):
            texts.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise InputError(f"messages[{i}].content must be a string or a list of parts")
        out = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif kind in IMAGE_PARTS:
                if m["role"] == "assistant":
                    raise InputError(f"messages[{i}].content[{j}]: an image in an assistant turn (images are input)")
                src = part.get("image") if kind == "image" else (part.get("image_url") or {}).get("url")
                if not isinstance(src, str) or not src:
                    raise InputError(f"messages[{i}].content[{j}]: an image part needs a path or data: URL")
                sources.append(src)
                out.append(SENTINEL)
            else:
                raise InputError(f"messages[{i}].content[{j}]: expected a text or image part, got {str(part)[:80]}")
        texts.append({"role": m["role"], "content": "".join(out)})
    return texts, sources


def _read(source: str, base_dir: Path):
    """A data: URL as is, else the bytes of the image file `source` (relative to `base_dir`)."""
    if source.startswith("data:"):
        return source
    path = Path(source) if Path(source).is_absolute() else base_dir / source
    if not path.is_file():
        raise InputError(f"image file not found: {str(path)!r}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read image file {str(path)!r} ({e.strerror or e})") from None


def _row_images(ids: list[int], inputs, cfg) -> RowImages:
    from flashnext.model.multimodal import get_rope_index

    t = torch.tensor(ids, dtype=torch.long)
    types = (t == cfg.image_token_id).long()
    positions, _ = get_rope_index(t, [0, len(ids)], types, inputs.image_grid_thw, cfg.vision_config.spatial_merge_size)
    return RowImages(inputs.pixel_values, inputs.image_grid_thw.long(), positions, types)
