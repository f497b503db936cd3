"""bf16 compute over fp32 master weights (`train.precision.MixedPrecision`, `train.compute_dtype`)."""

import copy
import json

import pytest
import torch
from test_trainer import _config, _write_pretokenized

from flashnext.checkpoint import training
from flashnext.config import TextConfig
from flashnext.errors import ConfigError
from flashnext.model.text import FlashNextForCausalLM
from flashnext.train.config import load_run_config
from flashnext.train.precision import MixedPrecision
from flashnext.train.trainer import Trainer

BATCHES = [  # two micro-batches: (ids, cu_seqlens)
    (torch.arange(23) * 7 % 64, torch.tensor([0, 9, 23], dtype=torch.int32)),
    (torch.arange(17) * 5 % 64, torch.tensor([0, 17], dtype=torch.int32)),
]


def _grads(model, mp, batches):
    model.zero_grad(set_to_none=True)
    with mp.compute():
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        for ids, cu in batches:
            model(ids, cu_seqlens=cu, labels=ids, return_logits=False).loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_window_computes_in_bf16_and_accumulates_fp32_gradients(small_config):
    model = FlashNextForCausalLM(TextConfig.from_dict(small_config))
    model.init_weights(seed=0)
    masters = {k: p.detach().clone() for k, p in model.named_parameters()}
    mp = MixedPrecision(model, torch.bfloat16)
    both = _grads(model, mp, BATCHES)
    # outside the window: the fp32 masters, untouched, carrying fp32 gradients
    assert all(p.dtype == torch.float32 and torch.equal(p, masters[k]) for k, p in model.named_parameters())
    assert all(g.dtype == torch.float32 for g in both.values()) and len(both) > 10
    # accumulation is an fp32 sum of each micro-batch's bf16 gradient (same instance and kernels: bitwise)
    first, second = _grads(model, mp, BATCHES[:1]), _grads(model, mp, BATCHES[1:])
    for k, g in both.items():
        assert torch.equal(g, first[k] + second[k]), k
    # and that gradient is the bf16 model's (another instance: bf16 rounding apart at most)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    for ids, cu in BATCHES[:1]:
        bf16(ids, cu_seqlens=cu, labels=ids, return_logits=False).loss.backward()
    for k, p in bf16.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(first[k], p.grad.float(), rtol=2e-2, atol=2e-3, msg=k)


def test_bf16_compute_run_keeps_fp32_state_and_resumes_bit_for_bit(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=16)
    args = ["--train.steps=3", "--train.compute_dtype=bfloat16", "--optim.lr=3e-3"]
    full = Trainer(_config(small_config, tmp_path / "a", data, *args, "--checkpoint.every=2"))
    history = full.run()
    assert all(p.dtype == torch.float32 for p in full.model.parameters())
    for opt in full.optimizers.values():
        for state in opt.state.values():
            assert all(v.dtype == torch.float32 for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    step2 = training.list_checkpoints(tmp_path / "a" / "run" / "checkpoints")[0]
    resumed = Trainer(
        _config(small_config, tmp_path / "b", data, *args, f"--checkpoint.resume={json.dumps(str(step2))}")
    )
    rest = resumed.run()
    assert [m["loss"] for m in rest] == [m["loss"] for m in history[2:]]  # same process, same kernels: bitwise
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_fp32_compute_with_bf16_parameters_is_refused():
    with pytest.raises(ConfigError, match=r"train\.compute_dtype='float32' needs fp32 parameters.*model\.dtype"):
        load_run_config(None, ["--model.dtype=bfloat16", "--train.compute_dtype=float32"])
    for extra in ([], ["--train.compute_dtype=bfloat16"]):  # pure bf16: compute_dtype follows model.dtype
        cfg = load_run_config(None, ["--model.dtype=bfloat16", *extra])
        assert cfg.train.compute_dtype == cfg.model.dtype == "bfloat16"
    assert load_run_config(None, []).train.compute_dtype == "float32"


def test_bf16_compute_trains_the_mtp_head_over_fp32_masters(small_config, tmp_path):
    """bf16 compute with `train.mtp_loss_weight`: the head's own AdamW steps fp32 masters with fp32 state."""
    from test_mtp_training import _trainer

    on = _trainer(small_config, tmp_path, "--train.mtp_loss_weight=1.0", "--train.compute_dtype=bfloat16")
    before = {k: v.clone() for k, v in on.model.state_dict().items() if k.startswith("mtp.")}
    reported = [on.train_step(on.next_micro_batches())["mtp_loss"] for _ in range(2)]
    assert all(0 < x < 6 for x in reported), reported
    assert all(p.dtype == torch.float32 for p in on.model.parameters())
    after = on.model.state_dict()
    assert any(not torch.equal(v, after[k]) for k, v in before.items())  # the head moved
    for state in on.optimizers["mtp"].state.values():
        assert all(v.dtype == torch.float32 for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


@pytest.mark.parametrize("native", [True, False], ids=["bf16_cpu", "avx2_cpu"])
def test_bf16_compute_on_a_cpu_without_bf16_instructions_warns(native, monkeypatch, caplog):
    """Training in bf16 where the CPU emulates bf16 products (`fused.NATIVE_GEMM`) says so and names the faster
    setting; fp32 training, and bf16 on a CPU with the instructions, say nothing."""
    from flashnext.model import fused
    from flashnext.train.setup import mixed_precision

    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, native)
    cpu = torch.device("cpu")
    for args, warns in ((["--model.dtype=bfloat16"], not native), ([], False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="flashnext.train"):
            assert mixed_precision(None, load_run_config(None, args), None, cpu) is None  # one dtype throughout
        said = [r.getMessage() for r in caplog.records if "without bf16 instructions" in r.getMessage()]
        assert bool(said) == warns, (args, caplog.text)
        if warns:
            assert "train.compute_dtype='float32'" in said[0]
