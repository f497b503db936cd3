"""`NgramTable`: every frozen n-gram storage answers the same questions (rows by ids, storage kind, bytes, save).

One FP8 checkpoint (quantised from a small fp32 model) is loaded with each frozen storage; the rows are compared
bitwise where the storages are bitwise by construction (`stored` and `mmap` dequantise the same FP8 bits with the
same op), `nf4` is lossy and only checked for its kind and bytes.
"""

from __future__ import annotations

import pytest
import torch

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint.quantize import quantize_checkpoint
from flashnext.config import parse_config
from flashnext.errors import CheckpointError, ConfigError
from flashnext.model.text import FlashNextForCausalLM
from flashnext.ngram import NF4NGramTable, NgramTable, OnDiskNGramTable, StoredNGramTable

KINDS = {"stored": StoredNGramTable, "nf4": NF4NGramTable, "mmap": OnDiskNGramTable}


def _table(model) -> torch.nn.Module:
    return model.model.layers[1].ple.ple_embedding.ngram_embedding


@pytest.fixture
def fp8_checkpoint(tmp_path, small_config):
    model = FlashNextForCausalLM(parse_config(dict(small_config, split_ngram_parts=3)).text).eval()
    model.init_weights(0)
    save_pretrained(model, tmp_path / "fp32")
    quantize_checkpoint(tmp_path / "fp32", tmp_path / "fp8")
    return tmp_path / "fp8"


def test_every_frozen_storage_is_an_ngram_table(fp8_checkpoint):
    tables = {s: _table(flashnext.from_pretrained(fp8_checkpoint, ngram_storage=s, ngram_resident_mb=1)) for s in KINDS}
    ids = torch.tensor([[3, 0, 3], [7, 1, 2]])
    for storage, table in tables.items():
        assert isinstance(table, NgramTable) and type(table) is KINDS[storage], storage
        assert table.storage == storage and not list(table.parameters())
        assert table(ids).shape == (2, 3, table.embedding_dim) and table(ids).dtype == torch.float32
    stored, nf4, ondisk = tables["stored"], tables["nf4"], tables["mmap"]
    assert torch.equal(ondisk(ids), stored(ids))  # the same FP8 bits, dequantised by the same op
    rows, width = stored.num_embeddings, stored.embedding_dim
    assert stored.nbytes == rows * width * 1 + stored.weight_scale.nbytes  # FP8: one byte per value
    assert nf4.nbytes == rows * (width // 2 + 2)  # two codes per byte + an fp16 scale per row
    assert 0 < ondisk.nbytes <= 1 << 20  # the row cache only, within ngram_resident_mb


def test_saved_entries_name_what_each_storage_writes_besides_its_state_dict(fp8_checkpoint, tmp_path):
    stored = _table(flashnext.from_pretrained(fp8_checkpoint, ngram_storage="stored"))
    assert stored.saved_entries("t", "text", 3, tmp_path / "out") == []  # its rows are buffers in state_dict
    ondisk = _table(flashnext.from_pretrained(fp8_checkpoint, ngram_storage="mmap"))
    entries = dict(ondisk.saved_entries("model.layers.1.ple.ple_embedding.ngram_embedding", "text", 3, tmp_path))
    shards = [entries[f"model.layers.1.ple.ple_embedding.ngram_embedding.shard_{j}.weight"] for j in range(3)]
    assert torch.equal(torch.cat(shards).view(torch.uint8), stored.weight.view(torch.uint8))
    assert torch.equal(entries["model.layers.1.ple.ple_embedding.ngram_embedding.weight_scale"], stored.weight_scale)
    with pytest.raises(CheckpointError, match="cannot save into"):
        ondisk.saved_entries("t", "text", 3, fp8_checkpoint)
    nf4 = _table(flashnext.from_pretrained(fp8_checkpoint, ngram_storage="nf4"))
    with pytest.raises(CheckpointError, match="cannot save t: an NF4 table"):
        nf4.saved_entries("t", "text", 3, tmp_path / "out")


def test_the_compiled_decode_step_refuses_a_table_read_from_disk(fp8_checkpoint):
    from flashnext.serve.decode_graph import DecodeGraph

    model = flashnext.from_pretrained(fp8_checkpoint, ngram_storage="mmap")
    with pytest.raises(ConfigError, match="the compiled decode step needs in-memory n-gram tables"):
        DecodeGraph(model, cache=None)  # refused before the cache is read
