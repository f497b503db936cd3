"""Image SFT datasets (`train/images.py`): chat rows whose content parts reference images by path or base64, packed
with text rows into MRoPE batches; bad rows named by file and line, fatal or skipped (`data.bad_rows`); and the
shipped tiny image run (`configs/tiny-image-sft.toml`) whose loss falls."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("transformers")

from flashnext.cli import main  # noqa: E402
from flashnext.config import load_config  # noqa: E402
from flashnext.errors import InputError  # noqa: E402
from flashnext.model.multimodal import get_rope_index  # noqa: E402
from flashnext.tokenizer import load_tokenizer  # noqa: E402
from flashnext.train.data import IGNORE, load_jsonl  # noqa: E402
from flashnext.train.images import ImageRows  # noqa: E402
from flashnext.train.packing import collate  # noqa: E402

ROOT = Path(__file__).parents[2]
SHIPPED = ROOT / "configs" / "tiny-image"
VS, VE, IMG = 512, 513, 514


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def cfg():
    return load_config(SHIPPED / "config.json")


def _rows(cfg, base: Path, max_tokens: int | None = 256) -> ImageRows:
    return ImageRows(cfg, base, max_tokens, min_pixels=256, max_pixels=256)


def _row(image, answer="red", question="What color is this?") -> dict:
    user = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def test_shipped_rows_load_by_path_and_base64_with_loss_on_the_answer_only(tok, cfg):
    examples = load_jsonl(SHIPPED / "train.jsonl", tok, limits=None, images=_rows(cfg, SHIPPED))
    lines = [json.loads(x) for x in (SHIPPED / "train.jsonl").read_text().splitlines()]
    inline = [x for x in lines if "messages" in x and x["messages"][0]["content"][0]["image"].startswith("data:")]
    assert inline and len(inline) < 48  # both kinds of reference are shipped
    with_images = [ex for ex in examples if ex.images is not None]
    assert len(with_images) == 48 and len(examples) == 64
    ex = with_images[0]
    start = ex.input_ids.index(VS)
    assert ex.input_ids[start : start + 6] == [VS, IMG, IMG, IMG, IMG, VE]  # 16 x 16 -> 4 x 4 patches -> 4 tokens
    labelled = [t for t, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != IGNORE]
    answer = json.loads(open(SHIPPED / "train.jsonl").readline())["messages"][1]["content"]
    # the generation prompt opens the think block: the labelled answer closes it (empty), then answers
    assert tok.decode(labelled, skip_special_tokens=False).startswith("\n</think>\n\n" + answer)
    assert all(lab == IGNORE for t, lab in zip(ex.input_ids, ex.labels, strict=True) if t in (VS, VE, IMG))
    assert ex.images.image_grid_thw.tolist() == [[1, 4, 4]] and ex.images.pixel_values.shape[0] == 16


def test_image_and_text_rows_pack_into_one_mrope_batch(tok, cfg):
    examples = load_jsonl(SHIPPED / "train.jsonl", tok, images=_rows(cfg, SHIPPED))
    image = [ex for ex in examples if ex.images is not None][:2]
    text = [ex for ex in examples if ex.images is None][:2]
    batch = collate([image[0], text[0], image[1], text[1]])
    assert batch.position_ids.shape == (3, batch.num_tokens)
    types = (batch.input_ids == IMG).long()
    want, _ = get_rope_index(batch.input_ids, batch.cu_seqlens.tolist(), types, batch.image_grid_thw, 2)
    assert torch.equal(batch.position_ids, want) and torch.equal(batch.mm_token_type_ids, types)
    assert batch.pixel_values.shape[0] == int(batch.image_grid_thw.prod(-1).sum())


def _bad_file(tmp_path: Path) -> Path:
    (tmp_path / "ok.png").write_bytes((SHIPPED / "images" / "red.png").read_bytes())
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    big = "data:image/png;base64," + base64.b64encode((SHIPPED / "images" / "blue.png").read_bytes()).decode()
    rows = [
        _row("ok.png"),  # 1: fine
        _row("missing.png"),  # 2: missing file
        _row("broken.png"),  # 3: undecodable
        _row("data:image/png;base64,@@@"),  # 4: bad base64
        _row(big, question="What color is this? " * 30),  # 5: too many tokens for the sequence
        {"prompt": "1+1=", "completion": "2"},  # 6: a text row
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_rows_are_fatal_or_skipped_with_file_and_line(tok, cfg, tmp_path):
    path = _bad_file(tmp_path)
    with pytest.raises(InputError, match=rf"^{path}:2: image file not found: .*missing.png"):
        load_jsonl(path, tok, images=_rows(cfg, tmp_path, max_tokens=100))
    with pytest.warns(UserWarning) as caught:
        examples = load_jsonl(path, tok, images=_rows(cfg, tmp_path, max_tokens=100), skip_bad=True)
    said = [str(w.message) for w in caught]
    assert [s.split(": ", 1)[0] for s in said] == [f"{path}:{n}" for n in (2, 3, 4, 5)]
    assert "cannot decode image" in said[1] and "base64" in said[2] and "too many image tokens" in said[3]
    assert all(s.endswith("(row skipped)") for s in said)
    assert len(examples) == 2 and examples[0].images is not None and examples[1].images is None


def test_a_text_model_names_an_image_row_as_bad(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(_row("x.png")) + "\n")
    with pytest.raises(InputError, match=rf"^{path}:1: .*no vision tower"):
        load_jsonl(path, tok, images=None)


def test_train_stops_on_a_bad_image_row_naming_file_and_line(tmp_path, capsys):
    path = _bad_file(tmp_path)
    args = ["train", "--config", str(ROOT / "configs" / "tiny-image-sft.toml"), f"--data.path={json.dumps(str(path))}",
            f"--out_dir={json.dumps(str(tmp_path / 'run'))}", "--train.steps=3", "--optim.warmup_steps=0"]  # fmt: skip
    _in_root = _chdir(ROOT)
    try:
        assert main(args) == 1
    finally:
        _in_root()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{path}:2: image file not found" in line


def test_tiny_image_sft_loss_falls(tmp_path):
    """The shipped config trains the composite model on image + text rows; its loss falls (6.24 -> 5.40 in 8 steps
    when written; the bound leaves room for other machines' rounding)."""
    args = ["train", "--config", str(ROOT / "configs" / "tiny-image-sft.toml"),
            f"--out_dir={json.dumps(str(tmp_path / 'run'))}", "--train.steps=8", "--train.threads=1"]  # fmt: skip
    _in_root = _chdir(ROOT)
    try:
        assert main(args) == 0
    finally:
        _in_root()
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses


def _chdir(path: Path):
    """The shipped config's paths are relative to the repository root: run from there, and go back after."""
    import os

    before = os.getcwd()
    os.chdir(path)
    return lambda: os.chdir(before)
