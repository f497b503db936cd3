"""The oracle harness itself: the reference runs, every weight is randomised, checkpoints reload exactly."""

import json

import torch
from transformers import Qwen4ExpForCausalLM
from transformers.models.qwen4_exp import modeling_qwen4_exp as ref_mod


def test_reference_runs_finite(tiny_text_config, build_reference):
    ref = build_reference(tiny_text_config(), seed=0)
    assert not ref.training
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = ref(ids, labels=ids)
    assert out.logits.shape == (2, 11, 128)
    assert out.logits.dtype == torch.float32
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    # Randomised weights must give a non-degenerate function.
    assert out.logits.std() > 0.1


def test_every_float_parameter_is_randomised(tiny_text_config, build_reference):
    ref = build_reference(tiny_text_config(), seed=0)
    seen = set()
    for name, mod in ref.named_modules():
        if isinstance(mod, ref_mod.Qwen4ExpTextRMSNorm):
            # Zero-init would hide a missing "1 +".
            assert mod.weight.abs().min() > 0 and mod.weight.std() > 0.05, name
            seen.add("norm")
        elif isinstance(mod, ref_mod.Qwen4ExpTextRMSNormGated):
            assert (mod.weight - 1).abs().max() > 0.05, name
            seen.add("gated_norm")
        elif isinstance(mod, ref_mod.Qwen4ExpTextPLELayer):
            assert mod.conv1d.weight.std() > 0.05, name  # zero-init would hide the dilated conv
            seen.add("ple_conv")
    assert seen == {"norm", "gated_norm", "ple_conv"}
    for name, p in ref.named_parameters():
        assert torch.isfinite(p).all(), name
        if p.numel() > 1:
            assert p.std() > 0, name


def test_integer_buffers_stay_as_built(tiny_text_config, build_reference):
    cfg = tiny_text_config(ple_layer_ids=[1, 2])
    a, b = build_reference(cfg, seed=0), build_reference(cfg, seed=1)
    bufs_a, bufs_b = dict(a.named_buffers()), dict(b.named_buffers())
    ngram = [n for n in bufs_a if "ple_embedding" in n]
    assert len(ngram) == 6
    for name in ngram:
        assert not bufs_a[name].is_floating_point()
        assert torch.equal(bufs_a[name], bufs_b[name]), name
    # Head table sizes are successive primes counted across PLE layers.
    assert bufs_a["model.layers.0.ple.ple_embedding.ngram_heads_vocab_sizes"].tolist() == [53, 59, 61, 67]
    assert bufs_a["model.layers.1.ple.ple_embedding.ngram_heads_vocab_sizes"].tolist() == [71, 73, 79, 83]


def test_seed_determines_weights(tiny_text_config, build_reference):
    cfg = tiny_text_config()
    a, b, c = (build_reference(cfg, seed=s) for s in (3, 3, 4))
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    name = "model.layers.3.self_attn.q_norm.weight"
    assert not torch.equal(pa[name], pc[name])


def test_checkpoint_reloads_identically(reference_checkpoint):
    ref, ckpt = reference_checkpoint
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "qwen4_exp_text"
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert files, "save_pretrained wrote no safetensors"
    from safetensors import safe_open

    keys = set()
    for f in ckpt.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            keys |= set(h.keys())
    # The official layout: n-gram table split into `split_ngram_parts` shards, per-expert weights.
    assert {f"model.layers.1.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(4)} <= keys
    assert any(".mlp.experts.0." in k for k in keys), sorted(keys)[:20]

    again = Qwen4ExpForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float32).eval()
    # Saving and loading copies every tensor: equal bit for bit, by construction.
    loaded = again.state_dict()
    assert all(torch.equal(t, loaded[k]) for k, t in ref.state_dict().items())
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # Two instances: the loaded weights sit at other alignments (views into the read file), MKL's GEMM
        # blocking depends on alignment and thread count, so logits agree to fp32 rounding (~1e-7), not bitwise.
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-6)


def test_factory_makes_distinct_checkpoints(tiny_text_config, reference_factory):
    _, d1 = reference_factory(tiny_text_config(hc_count=4), seed=1)
    _, d2 = reference_factory(tiny_text_config(ple_layer_ids=[]), seed=2)
    assert d1 != d2
    assert json.loads((d1 / "config.json").read_text())["hc_count"] == 4
    assert json.loads((d2 / "config.json").read_text())["ple_layer_ids"] == []
