"""Loading streams: peak RSS growth stays within 1.3x the bytes loaded (no second copy of any n-gram table)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_helpers import tiny_text

from flashnext import save_pretrained
from flashnext.config import ModelConfig, TextConfig
from flashnext.model.text import FlashNextForCausalLM

# Two PLE layers x 4 heads x ~1.2M rows x 8 dims fp32: ~307 MB of n-gram tables, ~0.2 MB of everything else.
BIG_NGRAM = dict(ngram_vocab_size_base=1_200_000, ple_embed_dim=32, ple_layer_ids=[1, 2], split_ngram_parts=4)

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch, safetensors.torch
    import flashnext, flashnext.checkpoint, flashnext.model.text

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    with torch.device("meta"):  # first meta-device use imports torch's meta kernels (~100 MB): not ours
        torch.nn.Embedding(2, 2)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark so it measures from here
    base = status("VmRSS")
    model = flashnext.from_pretrained(sys.argv[1])
    peak = status("VmHWM")
    loaded = sum(t.nbytes for t in model.state_dict().values())
    tables = {k: float(v.double().sum()) for k, v in model.state_dict().items() if k.endswith("ngram_embedding.weight")}
    print(json.dumps({"base": base, "peak": peak, "loaded": loaded, "tables": tables}))
    """
)


@torch.no_grad()
def write_big_checkpoint(directory: Path) -> dict[str, float]:
    """Save a model whose weights are almost all n-gram table; return each table's checksum."""
    cfg = TextConfig(**tiny_text(**BIG_NGRAM))
    with torch.device("meta"):
        model = FlashNextForCausalLM(cfg)
    model.to_empty(device="cpu")
    model.reset_buffers()
    sums = {}
    for name, p in model.named_parameters():
        p.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape) % 997)
        if name.endswith("ngram_embedding.weight"):
            sums[name] = float(p.double().sum())
    save_pretrained(model, directory, config=ModelConfig(text=cfg))
    return sums


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_load_peak_memory_is_streamed(tmp_path):
    sums = write_big_checkpoint(tmp_path / "big")
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "big")], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["loaded"] > 250e6
    assert got["tables"] == sums  # the tables arrived intact
    growth = got["peak"] - got["base"]
    assert growth <= 1.3 * got["loaded"], f"peak RSS grew {growth / 1e6:.0f} MB for {got['loaded'] / 1e6:.0f} MB"
