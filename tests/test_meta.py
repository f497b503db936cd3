"""Meta-device construction and forward with CUDA hidden and GPU packages unavailable.

FSDP2 and the FLOP counter build the model on `meta` before any weights exist, often on a host without a GPU.
This runs in a fresh interpreter so no earlier test can have imported a GPU package already. Imports of the GPU
packages are blocked (as if not installed), so a construction- or forward-time import fails loudly even on a
machine that has them.
"""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import json
    import os
    import sys
    from importlib import resources

    GPU_PACKAGES = ("fla", "triton", "flash_attn", "causal_conv1d")
    attempts = []

    class BlockGPU(importlib.abc.MetaPathFinder):
        # Make GPU packages unimportable; record the imports flashnext's own code attempts. torch probes
        # for triton itself (torch.utils._triton) -- torch's business, not ours.

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] not in GPU_PACKAGES:
                return None
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
                frame = frame.f_back
            importer = frame.f_code.co_filename if frame is not None else "?"
            if "flashnext" in importer.split(os.sep):
                attempts.append(f"{name} from {importer}:{frame.f_lineno}")
            raise ModuleNotFoundError(f"blocked by test_meta: {name}", name=name)

    sys.meta_path.insert(0, BlockGPU())

    import torch

    from flashnext.config import parse_config
    from flashnext.model.text import FlashNextForCausalLM

    cfg = parse_config(json.loads(resources.files("flashnext").joinpath("configs/tiny.json").read_text())).text
    with torch.device("meta"):
        model = FlashNextForCausalLM(cfg)
    assert all(p.device.type == "meta" for p in model.parameters()), "a parameter left the meta device"
    assert attempts == [], f"construction tried to import GPU packages: {attempts}"

    V = cfg.vocab_size
    # Packed: ids and positions on meta; cu_seqlens is host metadata (a meta tensor has no values to read).
    lengths = [7, 20, 1]
    T = sum(lengths)
    cu = torch.tensor([0, 7, 27, 28], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths]).to("meta")
    ids = torch.empty(T, dtype=torch.long, device="meta")
    out = model(ids, cu_seqlens=cu, position_ids=pos)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    assert logits.device.type == "meta" and tuple(logits.shape) == (T, V), (logits.device, logits.shape)

    # Padded [B, S] without a mask: every token is real.
    ids = torch.empty(3, 19, dtype=torch.long, device="meta")
    out = model(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    assert logits.device.type == "meta" and tuple(logits.shape) == (3, 19, V), (logits.device, logits.shape)

    loaded = sorted(m for m in sys.modules if m.split(".")[0] in GPU_PACKAGES)
    assert not loaded, f"GPU packages imported: {loaded}"
    assert attempts == [], f"forward tried to import GPU packages: {attempts}"
    assert not torch.cuda.is_initialized(), "CUDA was initialised"
    print("META-OK")
    """
)


def test_meta_construction_and_forward_without_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("FLASHNEXT_FORCE_REF", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "META-OK" in proc.stdout, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
