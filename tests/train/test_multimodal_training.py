"""Training a composite (vision-language) checkpoint: image-bearing packed batches step every group, activation
checkpointing finds the decoder, and a training checkpoint converts back to the composite layout."""

import json

import pytest
import torch
from test_trainer import _overrides, _write_pretokenized

import flashnext
from flashnext import save_pretrained
from flashnext.batch import PackedBatch
from flashnext.checkpoint import training
from flashnext.cli import main as cli_main
from flashnext.config import parse_config
from flashnext.model.multimodal import FlashNextForConditionalGeneration
from flashnext.train.config import load_run_config
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

IMG = 60
VISION = dict(
    depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=16, num_position_embeddings=9,
)  # fmt: skip


@pytest.fixture
def composite_checkpoint(small_config, tmp_path):
    cfg = parse_config(
        dict(model_type="qwen4_exp", text_config=small_config, vision_config=dict(VISION), image_token_id=IMG)
    )
    model = FlashNextForConditionalGeneration(cfg)
    model.init_weights(seed=0)
    save_pretrained(model, tmp_path / "vlm")
    return tmp_path / "vlm"


def _image_batch() -> PackedBatch:
    ids = [5, 6, 58, *[IMG] * 6, 59, 7, 8, 9]  # one (1, 4, 6) image -> 6 placeholders
    batch = PackedBatch.from_sequences([ids, [10, 11, 12, 13]], [ids, [10, 11, 12, 13]])
    batch.pixel_values = torch.randn(24, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(0))
    batch.image_grid_thw = torch.tensor([[1, 4, 6]])
    return batch


def test_trainer_steps_images_and_converts(small_config, composite_checkpoint, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=8)
    extra = [f"--model.path={json.dumps(str(composite_checkpoint))}", "--train.activation_checkpointing=true"]
    args = [a for a in _overrides(small_config, tmp_path, data, "--train.steps=1", *extra) if "overrides" not in a]
    trainer = Trainer(load_run_config(None, args))
    assert isinstance(trainer.model, FlashNextForConditionalGeneration)
    visual = trainer.model.model.visual
    before = visual.pos_embed.weight.detach().clone()
    metrics = trainer.train_step([_image_batch()])
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert not torch.equal(visual.pos_embed.weight, before)  # image gradients reached the tower's AdamW group
    ckpt = trainer.save_checkpoint()
    out = tmp_path / "hf"
    assert cli_main(["convert", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    back = flashnext.from_pretrained(out)
    assert isinstance(back, FlashNextForConditionalGeneration)
    state = training.load(ckpt)["model"]
    assert all(torch.equal(v, state[k]) for k, v in back.state_dict().items())


def test_trainer_trains_the_composite_mtp_head_on_images(small_config, tmp_path):
    """`train.mtp_loss_weight` on a composite checkpoint with an MTP layer: one step on an image batch reports the
    head's loss and moves its weights."""
    cfg = parse_config(
        dict(
            model_type="qwen4_exp",
            text_config={**small_config, "mtp_num_hidden_layers": 1},
            vision_config=dict(VISION),
            image_token_id=IMG,
        )
    )
    model = FlashNextForConditionalGeneration(cfg)
    model.init_weights(seed=0)
    save_pretrained(model, tmp_path / "vlm")
    data = _write_pretokenized(tmp_path / "d.jsonl", n=8)
    extra = [f"--model.path={json.dumps(str(tmp_path / 'vlm'))}", "--train.mtp_loss_weight=0.5"]
    args = [a for a in _overrides(small_config, tmp_path, data, "--train.steps=1", *extra) if "overrides" not in a]
    trainer = Trainer(load_run_config(None, args))
    assert trainer.model.mtp is not None
    before = trainer.model.mtp.fc_hidden.weight.detach().clone()
    metrics = trainer.train_step([_image_batch()])
    assert 0 < metrics["mtp_loss"] < 20 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert not torch.equal(trainer.model.mtp.fc_hidden.weight, before)
