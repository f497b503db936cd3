"""Writes configs/tiny-image/: the tiny composite model's config.json and a tiny image SFT set (deterministic).

- `config.json`: the embedded tiny text model (vocab 516: ids 512, 513, 514 are vision start, end and the image
  placeholder, outside the bundled tokenizer's 512) with a one-block vision tower (patch 4, merge 2).
- `images/*.png`: 16 x 16 solid-colour PNGs (8 colours, 2 shades each).
- `train.jsonl`: chat rows "what colour is this?" over those images, by path (`images/NAME.png`, relative to the
  file) and, for a few, inline as `data:image/png;base64,...`; interleaved with text rows (prompt/completion) so
  image and text rows pack together.

Run from the repository root: `python scripts/build_tiny_image_data.py [--out DIR]`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
from pathlib import Path

from PIL import Image

from flashnext.config import tiny_config_dict

COLORS = {
    "red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (240, 220, 30),
    "black": (10, 10, 10), "white": (245, 245, 245), "orange": (250, 140, 20), "purple": (140, 40, 180),
}  # fmt: skip
QUESTIONS = ["What color is this?", "Name the color.", "Which color do you see?"]
VISION = dict(
    depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
)  # fmt: skip


def png(rgb: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), rgb).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="configs/tiny-image")
    out = Path(ap.parse_args().out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    text = tiny_config_dict()
    text["vocab_size"] = 516
    config = dict(
        model_type="qwen4_exp", architectures=["Qwen4ExpForConditionalGeneration"], text_config=text,
        vision_config=VISION, vision_start_token_id=512, vision_end_token_id=513, image_token_id=514,
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rng = random.Random(0)
    images = {}
    for name, rgb in COLORS.items():
        for shade, delta in (("", 0), ("-dark", -40)):
            data = png(tuple(max(0, c + delta) for c in rgb))
            (out / "images" / f"{name}{shade}.png").write_bytes(data)
            images[f"{name}{shade}"] = (name, data)
    rows = []
    for i, (key, (name, data)) in enumerate(sorted(images.items())):
        for q in QUESTIONS:
            inline = i % 4 == 0 and q == QUESTIONS[0]
            source = "data:image/png;base64," + base64.b64encode(data).decode() if inline else f"images/{key}.png"
            user = [{"type": "image", "image": source}, {"type": "text", "text": q}]
            rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": name}]})
    for _ in range(16):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
    rng.shuffle(rows)
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}: config.json, {len(images)} images, {len(rows)} rows")


if __name__ == "__main__":
    main()
