"""Round trips with the reference: its save -> our load, our save -> its load, tensor for tensor."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import assert_same_tensors, build_text_reference, headers
from transformers import Qwen4ExpForCausalLM

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint import layout
from flashnext.errors import CheckpointError

CASES = {
    "ple": {},
    "no_ple": {"ple_layer_ids": []},
    "uneven_split": {"split_ngram_parts": 11},  # 240 rows -> 10 x 22 + 20
    "fewer_chunks_than_parts": {"split_ngram_parts": 100},  # torch.chunk gives 80 x 3
    "two_ple_layers_tied": {"ple_layer_ids": [1, 3], "tie_word_embeddings": True},
}


def ours_with_buffers(model) -> dict[str, torch.Tensor]:
    """Our state_dict plus the derived n-gram buffers (non-persistent for us, persistent in the reference)."""
    bufs = {k: b for k, b in model.named_buffers() if layout.is_derived_buffer(k)}
    return {**model.state_dict(), **bufs}


@pytest.mark.parametrize("rows,parts", [(240, 4), (240, 11), (240, 100), (16, 5), (7, 7), (7, 8), (1, 3), (10, 1)])
def test_ngram_shard_rows_match_torch_chunk(rows, parts):
    chunks = torch.chunk(torch.arange(rows), parts)
    assert layout.ngram_shard_rows(rows, parts) == [(int(c[0]), int(c[-1]) + 1) for c in chunks]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_reference_save_then_our_load_then_reference_load(tmp_path, case):
    ref = build_text_reference(**CASES[case])
    ref.save_pretrained(tmp_path / "ref")
    model = flashnext.from_pretrained(tmp_path / "ref")
    assert_same_tensors(ours_with_buffers(model), ref.state_dict())
    assert model.extra_tensors == {}

    save_pretrained(model, tmp_path / "ours")
    assert headers(tmp_path / "ours") == headers(tmp_path / "ref")  # same keys, shapes and dtypes on disk
    back, info = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set(), info
    assert_same_tensors(back.state_dict(), ref.state_dict())


def test_sharded_both_ways(tmp_path):
    ref = build_text_reference(split_ngram_parts=3)
    ref.save_pretrained(tmp_path / "ref", max_shard_size="40KB")
    assert (tmp_path / "ref" / "model.safetensors.index.json").is_file()
    model = flashnext.from_pretrained(tmp_path / "ref")
    assert_same_tensors(ours_with_buffers(model), ref.state_dict())

    limit = 40_000
    flashnext.checkpoint.save_pretrained(model, tmp_path / "ours", max_shard_bytes=limit)
    files = sorted((tmp_path / "ours").glob("model-*-of-*.safetensors"))
    assert len(files) > 1 and (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "ours" / "model.safetensors").exists()
    assert all(f.stat().st_size <= limit + 16_384 for f in files)  # header and one oversized tensor aside
    assert headers(tmp_path / "ours") == headers(tmp_path / "ref")
    back, info = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert_same_tensors(back.state_dict(), ref.state_dict())

    # Saving again is refused (the directory holds a checkpoint); with overwrite=True the directory is replaced
    # whole: no stale shard or index stays beside the new single file.
    (tmp_path / "ours" / "notes.txt").write_text("kept by hand")
    with pytest.raises(CheckpointError, match=r"ours' is not empty.*--overwrite"):
        save_pretrained(model, tmp_path / "ours")
    assert len(sorted((tmp_path / "ours").glob("model-*-of-*.safetensors"))) == len(files)  # untouched
    save_pretrained(model, tmp_path / "ours", overwrite=True)
    assert sorted(f.name for f in (tmp_path / "ours").iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".ours.*"))  # no staging or old directory left beside it
    assert not (tmp_path / "ours" / "model.safetensors.index.json").exists()
    assert_same_tensors(ours_with_buffers(flashnext.from_pretrained(tmp_path / "ours")), ref.state_dict())


def test_load_casts_to_requested_dtype(tmp_path):
    ref = build_text_reference()
    ref.save_pretrained(tmp_path / "ref")
    model = flashnext.from_pretrained(tmp_path / "ref", dtype=torch.bfloat16)
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ref.state_dict().items()}
    assert_same_tensors(ours_with_buffers(model), want)

    save_pretrained(model, tmp_path / "ours")
    assert {dt for _, dt in headers(tmp_path / "ours").values()} == {"BF16", "I64"}
    back = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "ours")
    assert back.dtype == torch.bfloat16
    assert_same_tensors(back.state_dict(), want)


def test_tiny_chunks_and_remaps_copy_exactly(tmp_path, monkeypatch):
    """Force the streaming reader to copy a few rows at a time and remap files constantly."""
    from flashnext.checkpoint import files

    monkeypatch.setattr(files, "CHUNK_BYTES", 100)
    monkeypatch.setattr(files, "MAP_BUDGET_BYTES", 300)
    ref = build_text_reference(split_ngram_parts=3)
    ref.save_pretrained(tmp_path / "ref", max_shard_size="40KB")
    assert_same_tensors(ours_with_buffers(flashnext.from_pretrained(tmp_path / "ref")), ref.state_dict())
