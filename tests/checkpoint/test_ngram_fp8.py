"""FP8 n-gram tables: the official layout (F8_E4M3 shards + one weight_scale per table), storage modes, errors.

The FP8 checkpoints here are written by the test itself (its own quantisation, `save_file`), so loading is
checked against an independent computation: the same model whose table holds `q.float() * scale` in fp32.
"""

from __future__ import annotations

import re

import pytest
import torch
from ckpt_helpers import headers
from safetensors.torch import load_file, save_file
from torch import nn

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint.layout import ngram_shard_rows
from flashnext.config import parse_config
from flashnext.errors import CheckpointError
from flashnext.model.text import FlashNextForCausalLM
from flashnext.ngram.nf4 import NF4NGramTable, dequantize_nf4, quantize_nf4
from flashnext.ngram.stored import StoredNGramTable

TABLE = "model.layers.1.ple.ple_embedding.ngram_embedding"
SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _model(small_config: dict, seed: int = 0) -> FlashNextForCausalLM:
    model = FlashNextForCausalLM(parse_config(dict(small_config, split_ngram_parts=3)).text).eval()
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def _table(model) -> nn.Module:
    return model.model.layers[1].ple.ple_embedding.ngram_embedding


def _quantize(table: torch.Tensor, scale_dtype: torch.dtype, fp8=torch.float8_e4m3fn):
    """The test's own FP8 quantisation: scale = amax / 448 stored in `scale_dtype`, rows / scale rounded."""
    scale = (table.abs().max() / 448).to(scale_dtype)
    return (table.float() / scale.float()).clamp(-448, 448).to(fp8), scale


def _write_fp8(directory, q: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Replace the table shards of the single-file checkpoint in `directory` by `q`'s rows (+ the scale)."""
    tensors = load_file(directory / "model.safetensors")
    shards = sorted(k for k in tensors if k.startswith(f"{TABLE}.shard_"))
    assert len(shards) == 3
    for j, (a, b) in enumerate(ngram_shard_rows(q.shape[0], 3)):
        tensors[f"{TABLE}.shard_{j}.weight"] = q[a:b].clone()
    tensors.pop(f"{TABLE}.weight_scale", None)
    if scale is not None:
        tensors[f"{TABLE}.weight_scale"] = scale.clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _packed_logits(model, vocab: int, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (30,), generator=gen)
    cu = torch.tensor([0, 17, 30], dtype=torch.int32)
    with torch.no_grad():
        return model(ids, cu_seqlens=cu).logits


@pytest.fixture
def fp8_checkpoint(tmp_path, small_config):
    """(directory, fp32 model it came from, q, scale) of an FP8-table checkpoint with an F32 scale."""
    model = _model(small_config)
    save_pretrained(model, tmp_path / "fp8")
    q, scale = _quantize(_table(model).weight.detach(), torch.float32)
    _write_fp8(tmp_path / "fp8", q, scale)
    return tmp_path / "fp8", model, q, scale


@pytest.mark.parametrize("scale_name", list(SCALE_DTYPES))
def test_fp8_table_logits_equal_the_dequantised_fp32_table(tmp_path, small_config, scale_name):
    model = _model(small_config)
    save_pretrained(model, tmp_path / "ckpt")
    q, scale = _quantize(_table(model).weight.detach(), SCALE_DTYPES[scale_name])
    _write_fp8(tmp_path / "ckpt", q, scale)

    loaded = flashnext.from_pretrained(tmp_path / "ckpt")
    table = _table(loaded)
    assert isinstance(table, StoredNGramTable)  # kept in FP8: 1 byte per value, frozen
    assert table.weight.dtype == torch.float8_e4m3fn and table.weight_scale.dtype == SCALE_DTYPES[scale_name]
    assert torch.equal(table.weight.view(torch.uint8), q.view(torch.uint8))
    assert not any("ngram_embedding" in n for n, _ in loaded.named_parameters())

    with torch.no_grad():  # the same weights, with the table dequantised in fp32 by the test
        _table(model).weight.copy_(q.float() * scale.float())
    ours, ref = _packed_logits(loaded, 64), _packed_logits(model, 64)
    # Two model instances: equal up to fp32 rounding of different kernel blockings, not bitwise.
    assert (ours - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_fp8_round_trip_is_byte_identical_and_survives_dtype_casts(tmp_path, fp8_checkpoint):
    src, _, q, scale = fp8_checkpoint
    loaded = flashnext.from_pretrained(src)
    save_pretrained(loaded, tmp_path / "again")
    # The whole file comes back byte for byte: FP8 shards, the scale in its dtype, every other tensor.
    assert (src / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()
    assert headers(tmp_path / "again")[f"{TABLE}.shard_0.weight"][1] == "F8_E4M3"

    loaded.to(torch.bfloat16)  # a model-wide cast: the stored bytes stay FP8, the lookups come out in bf16
    table = _table(loaded)
    assert table.weight.dtype == torch.float8_e4m3fn and torch.equal(
        table.weight.view(torch.uint8), q.view(torch.uint8)
    )
    assert table.weight_scale.dtype == torch.float32 and torch.equal(table.weight_scale, scale)
    ids = torch.arange(table.num_embeddings)
    assert torch.equal(table(ids), q.to(torch.bfloat16) * scale.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_storage_modes_look_up_the_same_bits(tmp_path, fp8_checkpoint, dtype):
    src, _, q, scale = fp8_checkpoint
    ids = torch.arange(q.shape[0]).flip(0)
    expected = (q.to(dtype) * scale.to(dtype))[ids]  # vLLM's lookup: rows.to(dtype) * scale.to(dtype)
    kinds = {"auto": StoredNGramTable, "stored": StoredNGramTable, "dense": nn.Embedding}
    for storage, kind in kinds.items():
        table = _table(flashnext.from_pretrained(src, dtype=dtype, ngram_storage=storage))
        assert isinstance(table, kind), storage
        assert torch.equal(table(ids), expected), storage
    dense = _table(flashnext.from_pretrained(src, dtype=dtype, ngram_storage="dense"))
    assert dense.weight.dtype == dtype and dense.weight.requires_grad  # trainable, upcast shard by shard at load


def test_stored_mode_keeps_a_bf16_table_in_bf16(tmp_path, small_config):
    model = _model(small_config).to(torch.bfloat16)
    save_pretrained(model, tmp_path / "bf16")
    table = _table(flashnext.from_pretrained(tmp_path / "bf16", dtype=torch.float32, ngram_storage="stored"))
    assert isinstance(table, StoredNGramTable) and table.weight.dtype == torch.bfloat16 and table.weight_scale is None
    ids = torch.arange(table.num_embeddings)
    assert torch.equal(table(ids), _table(model).weight.float())
    auto = _table(flashnext.from_pretrained(tmp_path / "bf16", dtype=torch.float32))
    assert isinstance(auto, nn.Embedding)  # a BF16 table is an ordinary trainable embedding unless asked


def _e5m2(d, q, scale):
    _write_fp8(d, q.float().to(torch.float8_e5m2), scale)


def _no_scale(d, q, scale):
    _write_fp8(d, q, None)


def _f64_scale(d, q, scale):
    _write_fp8(d, q, scale.double())


def _int_scale(d, q, scale):
    _write_fp8(d, q, torch.tensor(1, dtype=torch.int32))


def _two_scales(d, q, scale):
    _write_fp8(d, q, scale.repeat(2))


def _scale_beside_bf16(d, q, scale):
    _write_fp8(d, q.float().to(torch.bfloat16), scale)


BAD_LAYOUTS = {
    "e5m2": (_e5m2, rf"unsupported dtype: {TABLE}\.shard_0\.weight is F8_E5M2"),
    "missing_scale": (_no_scale, rf"missing: {TABLE}\.weight_scale \(the F8_E4M3"),
    "f64_scale": (_f64_scale, rf"wrong dtype: {TABLE}\.weight_scale is F64, expected one of F32, BF16, F16"),
    "int_scale": (_int_scale, rf"wrong dtype: {TABLE}\.weight_scale is I32"),
    "two_scales": (_two_scales, rf"mis-shaped: {TABLE}\.weight_scale is \[2\]"),
    "scale_beside_bf16": (
        _scale_beside_bf16,
        rf"unexpected: {TABLE}\.weight_scale \(a scale, but the table .* is \['BF16'\]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LAYOUTS))
@pytest.mark.parametrize("storage", ["auto", "dense", "mmap"])
def test_bad_fp8_layouts_are_refused_naming_the_key(fp8_checkpoint, case, storage):
    src, _, q, scale = fp8_checkpoint
    edit, message = BAD_LAYOUTS[case]
    edit(src, q, scale)
    with pytest.raises(CheckpointError) as err:
        flashnext.from_pretrained(src, ngram_storage=storage)
    assert any(re.search(message, p) for p in err.value.problems), err.value.problems


def test_unknown_storage_is_refused(fp8_checkpoint):
    with pytest.raises(CheckpointError, match=r"ngram_storage='disk': expected one of"):
        flashnext.from_pretrained(fp8_checkpoint[0], ngram_storage="disk")


@pytest.mark.parametrize("storage", ["auto", "dense", "mmap"])
def test_whole_fp8_table_in_the_state_dict_layout(tmp_path, fp8_checkpoint, storage):
    """`save_file(model.state_dict())` of an FP8-table model: one whole `...ngram_embedding.weight` + its scale."""
    src, _, q, scale = fp8_checkpoint
    loaded = flashnext.from_pretrained(src)
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "config.json").write_text((src / "config.json").read_text())
    state = {k: v.contiguous() for k, v in loaded.state_dict().items()}
    assert state[f"{TABLE}.weight"].dtype == torch.float8_e4m3fn and f"{TABLE}.weight_scale" in state
    save_file(state, tmp_path / "sd" / "model.safetensors", metadata={"format": "pt"})
    table = _table(flashnext.from_pretrained(tmp_path / "sd", ngram_storage=storage))
    ids = torch.arange(q.shape[0])
    assert torch.equal(table(ids), q.float() * scale.float())  # never the raw FP8 values without the scale

    del state[f"{TABLE}.weight_scale"]
    save_file(state, tmp_path / "sd" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        flashnext.from_pretrained(tmp_path / "sd", ngram_storage=storage)
    assert any(p.startswith(f"missing: {TABLE}.weight_scale") for p in err.value.problems), err.value.problems


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_nf4_storage_quantises_the_stored_rows_at_load(tmp_path, small_config, fp8_checkpoint, kind):
    src, model, q, scale = fp8_checkpoint
    stored = q.float() * scale.float()  # the values an FP8 table holds
    if kind == "bf16":
        src = tmp_path / "bf16"
        save_pretrained(model.to(torch.bfloat16), src)
        stored = _table(model).weight.detach().float()
        model.float()
    nf4 = flashnext.from_pretrained(src, ngram_storage="nf4")
    table = _table(nf4)
    assert isinstance(table, NF4NGramTable) and not list(nf4.state_dict().keys() & {f"{TABLE}.weight"})
    codes, row_scale = quantize_nf4(stored)
    ids = torch.arange(stored.shape[0]).flip(0)
    assert torch.equal(table(ids), dequantize_nf4(codes, row_scale, torch.float32)[ids])
    dense = flashnext.from_pretrained(src, ngram_storage="dense")
    unquantised = _packed_logits(dense, 64)
    with torch.no_grad():  # the same model holding the NF4 values as an fp32 table
        _table(dense).weight.copy_(dequantize_nf4(codes, row_scale, torch.float32))
    ours, ref = _packed_logits(nf4, 64), _packed_logits(dense, 64)
    # Two model instances: equal up to fp32 rounding of different kernel blockings, not bitwise.
    assert (ours - ref).abs().max() <= 1e-6 * ref.abs().max() and not torch.allclose(ours, unquantised)
    with pytest.raises(CheckpointError, match="an NF4 table is a lossy in-memory copy"):
        save_pretrained(nf4, tmp_path / "out")
