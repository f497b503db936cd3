"""n-gram tables read from the checkpoint files (`ngram_storage="mmap"`): same rows and tokens, bounded memory.

Bitwise comparisons swap the table module inside one model instance, so everything but the table runs the same
kernels on the same shapes; the rows themselves are compared bitwise across instances (they are stored bits
converted by the same op).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from serve_helpers import small_model
from torch import nn

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint.quantize import quantize_checkpoint
from flashnext.cli import main as cli_main
from flashnext.config import parse_config
from flashnext.errors import CheckpointError, InputError
from flashnext.ngram.ondisk import OnDiskNGramTable
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams
from flashnext.synthetic import write_synthetic_checkpoint

KINDS = ("fp32", "bf16", "fp8")


@pytest.fixture
def checkpoints(tmp_path, small_config):
    """fp32, bf16 and fp8 (quantised from the bf16 one) checkpoints of one small model, tables in 3 shards."""
    root = tmp_path / "ckpts"
    model = small_model(dict(small_config, split_ngram_parts=3), seed=5)
    save_pretrained(model, root / "fp32")
    save_pretrained(model.to(torch.bfloat16), root / "bf16")
    quantize_checkpoint(root / "bf16", root / "fp8")
    return root


def _ple(model) -> nn.Module:
    return model.model.layers[1].ple.ple_embedding


def _logits(model, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (40,), generator=gen)
    with torch.no_grad():
        return model(ids, cu_seqlens=torch.tensor([0, 9, 31, 40], dtype=torch.int32)).logits


@pytest.mark.parametrize("kind", KINDS)
def test_ondisk_rows_and_packed_forward_equal_the_in_memory_table(checkpoints, kind):
    model = flashnext.from_pretrained(checkpoints / kind)
    disk = _ple(flashnext.from_pretrained(checkpoints / kind, ngram_storage="mmap", ngram_resident_mb=0.001))
    table = disk.ngram_embedding
    assert isinstance(table, OnDiskNGramTable) and not list(table.parameters()) and not list(table.buffers())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, table.num_embeddings, (3, 70), generator=gen)  # duplicates, any order, 2-D
    in_memory = _ple(model).ngram_embedding
    for _ in range(2):  # the second pass is served partly from the row cache
        assert torch.equal(table(ids), in_memory(ids))
    assert table.cache_hits > 0 and table.cache.nbytes + table.tags.nbytes <= 0.001 * 2**20

    before = _logits(model)
    _ple(model).ngram_embedding = table  # same instance, only the table module changes
    assert torch.equal(_logits(model), before)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_ondisk_engine_greedy_tokens_equal_the_in_memory_ones(checkpoints, kind):
    torch.set_num_threads(1)
    model = flashnext.from_pretrained(checkpoints / kind)
    prompts = [[5, 9, 2, 7, 7], [1, 3, 3, 3], [11, 12, 13, 14, 15, 16, 17]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in Engine(model, None, 4, 64, 16).generate(prompts, params)]
    _ple(model).ngram_embedding = _ple(
        flashnext.from_pretrained(checkpoints / kind, ngram_storage="mmap")
    ).ngram_embedding
    got = [c.token_ids for c in Engine(model, None, 4, 64, 16).generate(prompts, params)]
    assert got == expected


def test_ondisk_table_cache_counters_errors_and_save(tmp_path, checkpoints):
    model = flashnext.from_pretrained(checkpoints / "fp8", ngram_storage="mmap", ngram_resident_mb=0)
    table = _ple(model).ngram_embedding
    assert table.cache.size == 0 and table.scale is not None  # no cache: every lookup reads the files
    ids = torch.tensor([4, 4, 90, 3, 91, 92])
    table(ids)
    table(ids)
    assert (table.rows_read, table.cache_hits) == (10, 0)  # distinct ids once per lookup, coalesced runs

    cached = _ple(flashnext.from_pretrained(checkpoints / "fp8", ngram_storage="mmap")).ngram_embedding
    cached(ids)
    cached(ids)
    assert (cached.rows_read, cached.cache_hits) == (5, 5)
    with pytest.raises(InputError, match=rf"n-gram id {table.num_embeddings} at flat position 1 is outside"):
        table(torch.tensor([0, table.num_embeddings]))

    save_pretrained(model, tmp_path / "copy")  # rows copied from the files: the FP8 bytes come back unchanged
    src, dst = load_file(checkpoints / "fp8" / "model.safetensors"), load_file(tmp_path / "copy" / "model.safetensors")
    tables = [k for k in src if ".ngram_embedding." in k]
    assert len(tables) == 4  # 3 shards + the scale
    for key in tables:
        assert src[key].dtype == dst[key].dtype and src[key].shape == dst[key].shape, key
        assert src[key].reshape(-1).view(torch.uint8).tolist() == dst[key].reshape(-1).view(torch.uint8).tolist(), key
    with pytest.raises(CheckpointError, match="reads its rows from files there"):
        save_pretrained(model, checkpoints / "fp8")


def test_generate_cli_with_ondisk_tables(checkpoints, capsys):
    args = ["generate", "--model", str(checkpoints / "fp8"), "--ids", "5,9,2,7", "--max-tokens", "8"]
    assert cli_main(args) == 0
    expected = capsys.readouterr().err.split("ids=")[1]
    assert cli_main([*args, "--ngram-storage", "mmap", "--ngram-resident-mb", "1"]) == 0
    assert capsys.readouterr().err.split("ids=")[1] == expected
    assert cli_main([*args, "--ngram-storage", "nf4"]) == 0  # 4-bit rows: runs, tokens may differ
    capsys.readouterr()
    assert cli_main(["generate", "--ngram-storage", "mmap", "--ids", "1,2"]) == 1
    assert "--ngram-storage mmap needs a checkpoint (--model DIR)" in capsys.readouterr().err


RSS_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np, psutil, torch, flashnext
    from flashnext.serve.engine import Engine
    from flashnext.serve.sampling import SamplingParams

    torch.set_num_threads(1)
    model = flashnext.from_pretrained(sys.argv[1], ngram_storage="mmap", ngram_resident_mb=float(sys.argv[2]))
    table = model.model.layers[1].ple.ple_embedding.ngram_embedding
    engine = Engine(model, None, 8, 256, 64)
    prompts = [list(range(i, i + 8)) for i in range(8)]
    engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    proc = psutil.Process()
    base = peak = proc.memory_info().rss
    for p in prompts:  # a long generation...
        engine.add_request(p, SamplingParams(max_tokens=128, temperature=1.0, seed=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, proc.memory_info().rss)
    order = np.random.default_rng(0).permutation(table.num_embeddings)
    for a in range(0, order.size, 1024):  # ...then every row of the table, in random order
        table(torch.from_numpy(order[a : a + 1024]))
        peak = max(peak, proc.memory_info().rss)
    print(json.dumps({"growth": peak - base, "read": table.rows_read, "cache": table.cache.nbytes + table.tags.nbytes}))
    """
)


def test_ondisk_rss_stays_within_the_budget(tmp_path, small_config):
    # 16 heads x 31.25k rows x 128 BF16 values: a 128 MB table, read in full through a 16 MB budget.
    big = dict(heads_per_ngram=8, ple_embed_dim=2048, ngram_vocab_size_base=31_250, split_ngram_parts=4)
    cfg = parse_config(dict(small_config, **big)).text
    table_bytes = write_synthetic_checkpoint(cfg, tmp_path / "big", dtype=torch.float32)
    run = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(tmp_path / "big"), "16"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["read"] >= table_bytes // 256 and got["cache"] <= 16 << 20  # every row read; 256 B per row
    # The row cache fills to its 16 MiB; the rest is the lookups' transient buffers and allocator slack (~6 MiB
    # measured, 7 MiB with no cache at all). A table whose pages stayed resident (a plain memory map), or a cache
    # without a bound, would grow by the whole 128 MB (149 MB measured with a 512 MiB budget).
    assert got["growth"] <= (16 << 20) + (16 << 20), f"RSS grew {got['growth'] / 2**20:.0f} MiB"


@pytest.mark.parametrize("storage", ["mmap", "nf4"])
@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_truncated_or_corrupt_table_file_is_named_with_its_sizes(tmp_path, small_config, storage, damage):
    """The file holding a table's rows, cut short (or its header garbled): the error names the file and, for a
    short file, the size its header describes and the size it has (before: "no n-gram table rows")."""
    model = small_model(dict(small_config, split_ngram_parts=3), seed=5)
    save_pretrained(model, tmp_path / "ck", max_shard_bytes=20_000)
    files = sorted((tmp_path / "ck").glob("model-*.safetensors"))
    table_file = next(f for f in files if "ngram_embedding.shard_" in f.read_bytes()[:4096].decode(errors="replace"))
    size = table_file.stat().st_size
    if damage == "truncated":
        with open(table_file, "r+b") as f:
            f.truncate(size - 100)
        pattern = rf"{table_file.name}.*truncated.*{size}.*{size - 100}"
    else:
        raw = bytearray(table_file.read_bytes())
        raw[8:16] = b"\x00garbage"  # the JSON header no longer parses
        table_file.write_bytes(bytes(raw))
        pattern = rf"{table_file.name}.*(not a safetensors file|header)"
    with pytest.raises(CheckpointError, match=pattern):
        flashnext.from_pretrained(tmp_path / "ck", ngram_storage=storage)
