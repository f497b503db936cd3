"""`flashnext quantize --ngram fp8`: BF16/FP32 tables -> the official FP8 layout, streamed; everything else as is."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_ngram_fp8 import TABLE, _model, _packed_logits, _table

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint.files import INDEX_FILE
from flashnext.checkpoint.quantize import quantize_checkpoint
from flashnext.cli import main as cli_main
from flashnext.config import parse_config
from flashnext.errors import CheckpointError
from flashnext.synthetic import write_synthetic_checkpoint


def _all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture
def bf16_checkpoint(tmp_path, small_config):
    """A sharded BF16 checkpoint (index + several files) with a tokenizer-like extra file."""
    model = _model(small_config).to(torch.bfloat16)
    save_pretrained(model, tmp_path / "bf16", max_shard_bytes=20_000)
    (tmp_path / "bf16" / "tokenizer_config.json").write_text('{"eos_token": "x"}\n')
    return tmp_path / "bf16"


def test_quantize_bf16_checkpoint_to_fp8(tmp_path, bf16_checkpoint):
    scales = quantize_checkpoint(bf16_checkpoint, tmp_path / "fp8")
    bf16 = flashnext.from_pretrained(bf16_checkpoint)  # fp32 model holding the bf16 values
    table = _table(bf16).weight.detach()
    scale = table.abs().max() / 448  # amax / 448, computed here independently
    assert scales == {TABLE: pytest.approx(float(scale), rel=0, abs=0)}

    # The test's own dequantisation of the test's own quantisation.
    deq = (table / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    # FP8 E4M3 rounding error: 2^-4 relative for normal values, half the smallest subnormal (2^-10 * scale) below.
    bound = torch.maximum(table.abs() * 2**-4, scale * 2**-10 * torch.ones_like(table))
    assert ((deq - table).abs() <= bound).all() and not torch.equal(deq, table)

    fp8 = flashnext.from_pretrained(tmp_path / "fp8")
    assert torch.equal(_table(fp8)(torch.arange(table.shape[0])), deq)  # the loaded table is exactly that
    ours, ref_bf16 = _packed_logits(fp8, 64), _packed_logits(bf16, 64)
    with torch.no_grad():
        _table(bf16).weight.copy_(deq)
    ref = _packed_logits(bf16, 64)
    # Two model instances: equal up to fp32 rounding of different kernel blockings, not bitwise.
    assert (ours - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert not torch.allclose(ours, ref_bf16, rtol=0, atol=1e-6)  # the quantisation did change the logits


def test_quantize_copies_everything_else_byte_for_byte(tmp_path, bf16_checkpoint):
    quantize_checkpoint(bf16_checkpoint, tmp_path / "fp8")
    src, dst = _all_tensors(bf16_checkpoint), _all_tensors(tmp_path / "fp8")
    shards = {k for k in src if k.startswith(f"{TABLE}.shard_")}
    assert len(shards) == 3 and set(dst) == set(src) | {f"{TABLE}.weight_scale"}
    for key in set(src) - shards:
        assert src[key].dtype == dst[key].dtype and torch.equal(src[key], dst[key]), key
    for key in shards:
        assert dst[key].dtype == torch.float8_e4m3fn and dst[key].shape == src[key].shape, key
    assert dst[f"{TABLE}.weight_scale"].dtype == torch.float32 and dst[f"{TABLE}.weight_scale"].shape == ()
    index = json.loads((tmp_path / "fp8" / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(dst)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in dst.values())
    assert sorted(p.name for p in (tmp_path / "fp8").iterdir()) == sorted(p.name for p in bf16_checkpoint.iterdir())
    assert (tmp_path / "fp8" / "tokenizer_config.json").read_text() == '{"eos_token": "x"}\n'


def test_quantize_refusals(tmp_path, bf16_checkpoint):
    quantize_checkpoint(bf16_checkpoint, tmp_path / "fp8")
    with pytest.raises(CheckpointError, match=r"cannot quantize .*shard_0\.weight: it is F8_E4M3"):
        quantize_checkpoint(tmp_path / "fp8", tmp_path / "again")
    with pytest.raises(CheckpointError, match="OUT must differ from IN"):
        quantize_checkpoint(bf16_checkpoint, bf16_checkpoint)
    with pytest.raises(CheckpointError, match=r"--ngram 'nf4': expected one of \('fp8',\)"):
        quantize_checkpoint(bf16_checkpoint, tmp_path / "x", ngram="nf4")


def test_quantize_cli(tmp_path, bf16_checkpoint, capsys):
    assert cli_main(["quantize", "--ngram", "fp8", str(bf16_checkpoint), str(tmp_path / "fp8")]) == 0
    out = capsys.readouterr().out
    assert f"{TABLE}: F8_E4M3, weight_scale" in out and "1 table(s) in FP8" in out
    assert flashnext.from_pretrained(tmp_path / "fp8") is not None
    assert cli_main(["quantize", "--ngram", "fp8", str(tmp_path / "fp8"), str(tmp_path / "b")]) == 1
    assert "it is F8_E4M3" in capsys.readouterr().err



def test_quantize_into_a_directory_holding_another_checkpoint(tmp_path, small_config, capsys):
    """OUT holds a sharded checkpoint of another model; the new one is a single file. Refused without --overwrite
    (OUT untouched); with it OUT holds exactly the new files and the loader loads the new model (before: the old
    index stayed beside the new file and the loader read the old model through it)."""
    src = tmp_path / "src"
    save_pretrained(_model(small_config, seed=0).to(torch.bfloat16), src)
    out = tmp_path / "out"
    old = _model(small_config, seed=7).to(torch.bfloat16)
    save_pretrained(old, out, max_shard_bytes=sum(t.nbytes for t in old.state_dict().values()) // 2)
    old_files = sorted(f.name for f in out.iterdir())
    assert INDEX_FILE in old_files and len(list(out.glob("model-*-of-*.safetensors"))) >= 2

    assert cli_main(["quantize", "--ngram", "fp8", str(src), str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "--overwrite" in err, err
    assert sorted(f.name for f in out.iterdir()) == old_files

    assert cli_main(["quantize", "--ngram", "fp8", "--overwrite", str(src), str(out)]) == 0
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [f.name for f in tmp_path.iterdir() if f.name.startswith(".")]  # no staging dir left
    fresh = tmp_path / "fresh"
    quantize_checkpoint(src, fresh)
    loaded, expected = flashnext.from_pretrained(out), flashnext.from_pretrained(fresh)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), expected.state_dict().values(),
                                                 strict=True))  # fmt: skip
    with pytest.raises(CheckpointError, match="must differ from IN.*not contain it"):
        quantize_checkpoint(src, tmp_path, overwrite=True)  # replacing tmp_path would delete IN

MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch, flashnext
    from flashnext.checkpoint.quantize import quantize_checkpoint

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    def reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS mark so it measures from here
        return status("VmRSS")

    with torch.device("meta"):  # first meta-device use imports torch's meta kernels (~100 MB): not ours
        torch.nn.Embedding(2, 2)
    base = reset()
    quantize_checkpoint(sys.argv[1], sys.argv[2])
    quantize = status("VmHWM") - base
    base = reset()
    model = flashnext.from_pretrained(sys.argv[2], ngram_storage="dense")  # FP8 upcast shard by shard
    dense = status("VmHWM") - base
    loaded = sum(t.nbytes for t in model.state_dict().values())
    print(json.dumps({"quantize": quantize, "dense": dense, "loaded": loaded}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_quantize_and_dense_upcast_are_streamed(tmp_path, small_config):
    # ~192 MB of FP32 table (16 heads x 375k rows x 8 values) in 4 shards, a few hundred KB of everything else.
    big = dict(heads_per_ngram=8, ple_embed_dim=128, ngram_vocab_size_base=375_000, split_ngram_parts=4)
    cfg = parse_config(dict(small_config, **big)).text
    table_bytes = write_synthetic_checkpoint(cfg, tmp_path / "f32", dtype=torch.float32, table_dtype="F32")
    assert table_bytes > 190e6
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(tmp_path / "f32"), str(tmp_path / "fp8")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # Quantising works in 1 MiB pieces: its peak is a few pieces (~11 MB measured), not the table (192 MB) nor its
    # FP8 copy (48 MB).
    assert got["quantize"] < table_bytes / 6, f"quantize peak RSS grew {got['quantize'] / 1e6:.0f} MB"
    # Loading the FP8 checkpoint into an fp32 table costs the table once (no FP8 copy of it held beside it).
    assert got["loaded"] > table_bytes and got["dense"] <= 1.3 * got["loaded"]
