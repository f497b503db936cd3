"""Checkpoints other tools write give the reference's logits: the `model.state_dict()` layout (stacked experts,
whole n-gram tables) and older configs with `rope_theta` / `partial_rotary_factor` at the top level."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen4ExpForCausalLM

import flashnext

# Two model instances (ours, the reference) sum in different orders: fp32 noise ~1e-6, as in test_parity.
TOL = 1e-4


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(seed))


def test_state_dict_layout_gives_reference_logits(tiny_text_config, build_reference, rel_error, tmp_path):
    ref = build_reference(tiny_text_config(), seed=7)
    ref.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    ours = flashnext.from_pretrained(tmp_path)
    ids = _ids(128)
    with torch.no_grad():
        assert rel_error(ours(ids).logits, ref(ids).logits) <= TOL


ROPE_CONFIGS = {
    # rope_parameters without theta / factor; the top level has them
    "top-level-only": ({"rope_type": "default"}, {"rope_theta": 5e5, "partial_rotary_factor": 0.25}),
    # both: rope_parameters' value wins, the missing factor comes from the top level
    "both": ({"rope_type": "default", "rope_theta": 5e5}, {"rope_theta": 10.0, "partial_rotary_factor": 0.25}),
}


@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
def test_top_level_rope_fields_give_reference_logits(name, tiny_text_config, reference_factory, rel_error):
    ref, path = reference_factory(tiny_text_config(rope_theta=5e5, partial_rotary_factor=0.25), seed=8)
    rope, top = ROPE_CONFIGS[name]
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **top, "rope_parameters": rope}))

    theirs = Qwen4ExpForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert theirs.config.rope_parameters["rope_theta"] == 5e5  # the oracle merges as we expect
    assert theirs.config.rope_parameters["partial_rotary_factor"] == 0.25
    ours = flashnext.from_pretrained(path)
    assert (ours.config.rope_theta, ours.config.rotary_dim) == (5e5, 4)
    ids = _ids(128, seed=1)
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(theirs(ids).logits, want, rtol=1e-5, atol=1e-5)  # two instances: not bitwise
        assert rel_error(ours(ids).logits, want) <= TOL
        # The defaults the old parser read (theta 1e4, factor 1.0) give other logits: the test can tell.
        (path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "default"}}))
        assert rel_error(flashnext.from_pretrained(path)(ids).logits, want) > 100 * TOL
