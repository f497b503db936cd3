"""Optimizer groups (Muon / per-expert Muon / AdamW / frozen indexer), one real step, schedule and clipping."""

import math

import pydantic
import pytest
import torch

from flashnext.config import TextConfig
from flashnext.model.text import FlashNextForCausalLM
from flashnext.train.optim import (
    ADAMW_DECAY,
    ADAMW_NO_DECAY,
    FROZEN,
    MUON,
    MUON_EXPERTS,
    ExpertMuon,
    Muon,
    OptimConfig,
    Schedulers,
    batched_newton_schulz,
    build_optimizer,
    clip_grad_norm,
    lr_lambda,
    trainable_params,
)


@pytest.fixture
def model(small_config):
    torch.manual_seed(0)
    m = FlashNextForCausalLM(TextConfig.from_dict(small_config))
    m.init_weights(seed=0)
    return m


def _group_of(report, suffix):
    groups = {g for name, g in report.items() if name.endswith(suffix)}
    assert groups, f"no parameter ends with {suffix}"
    return groups


def test_parameter_groups(model):
    optimizers, report = build_optimizer(model, OptimConfig())
    for name, group in report.items():
        print(f"{group:15s} {name} {tuple(model.get_parameter(name).shape)}")

    assert _group_of(report, "ngram_embedding.weight") == {ADAMW_DECAY}  # every n-gram table in AdamW
    for suffix in ("embed_tokens.weight", "lm_head.weight", "conv1d.weight"):
        assert _group_of(report, suffix) == {ADAMW_DECAY}, suffix
    for suffix in ("linear_attn.norm.weight", "hc_norm.weight", "q_norm.weight", "A_log", "dt_bias"):
        assert _group_of(report, suffix) == {ADAMW_NO_DECAY}, suffix
    for suffix in (
        "self_attn.q_proj.weight",
        "self_attn.o_proj.weight",
        "linear_attn.in_proj_qkv.weight",
        "linear_attn.out_proj.weight",
        "mlp.gate.weight",
        "shared_expert.down_proj.weight",
        "shared_expert_gate.weight",
        "input_mix_weight_down.weight",
        "block_inject_weight.weight",
        "ple.key_proj.weight",
    ):
        assert _group_of(report, suffix) == {MUON}, suffix
    assert _group_of(report, "experts.gate_up_proj") == {MUON_EXPERTS}
    assert _group_of(report, "experts.down_proj") == {MUON_EXPERTS}

    indexer = {n for n in report if ".self_attn.indexer." in n}
    assert indexer and all(report[n] == FROZEN for n in indexer)
    assert all(not model.get_parameter(n).requires_grad for n in indexer)

    # Every trainable parameter is in exactly one optimizer group; frozen ones in none.
    held = [id(p) for p in trainable_params(optimizers)]
    assert len(held) == len(set(held))
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(held) == trainable
    assert all(id(model.get_parameter(n)) not in set(held) for n in indexer)
    assert set(report) == {n for n, _ in model.named_parameters()}
    assert {g["name"]: g["weight_decay"] for g in optimizers["adamw"].param_groups} == {
        ADAMW_DECAY: 0.1,
        ADAMW_NO_DECAY: 0.0,
    }


def test_one_step_moves_trainable_and_keeps_indexer(model):
    optimizers, report = build_optimizer(model, OptimConfig(lr=1e-2, muon_lr=1e-2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 64, (40,), generator=g)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    loss = model(ids, cu_seqlens=cu, labels=ids).loss
    loss.backward()
    norm = clip_grad_norm(trainable_params(optimizers), 1.0)
    assert torch.isfinite(norm) and norm > 0
    for opt in optimizers.values():
        opt.step()
        opt.zero_grad()
    after = dict(model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    for group in (MUON, MUON_EXPERTS, ADAMW_DECAY, ADAMW_NO_DECAY):
        assert any(report[n] == group for n in changed), f"no {group} parameter moved"
    for suffix in ("ngram_embedding.weight", "embed_tokens.weight", "lm_head.weight", "A_log", "q_proj.weight"):
        assert any(n.endswith(suffix) for n in changed), suffix
    assert all(report[n] != FROZEN for n in changed), "the frozen indexer moved"


def _same_update(ours: torch.Tensor, theirs: torch.Tensor, init: torch.Tensor, what) -> None:
    """Our batched bf16 Newton-Schulz (`baddbmm` over a stack) against torch's one matrix at a time (`addmm`).

    Not bitwise by construction: different GEMM kernels may sum the fp32 accumulators in another order, and one
    flipped bf16 rounding of an orthogonalised entry moves an update entry by a few percent of the largest (as in
    the FSDP Muon test). So the updates agree to 5% of their largest entry and 1% in Frobenius norm; a wrong
    learning-rate scale, momentum or weight decay moves them by far more.
    """
    got, want = ours - init, theirs - init
    scale, fro = float(want.abs().max()), float((got - want).norm() / want.norm())
    assert scale > 0 and float((got - want).abs().max()) <= 0.05 * scale and fro <= 0.01, (what, scale, fro)


@pytest.mark.parametrize("E,m,n", [(3, 6, 4), (4, 8, 24)])
def test_expert_update_depends_only_on_its_own_gradient(E, m, n):
    torch.manual_seed(0)
    init = torch.randn(E, m, n)
    grads = [torch.randn(E, m, n) for _ in range(2)]

    def run(grad_seq):
        p = torch.nn.Parameter(init.clone())
        opt = ExpertMuon([p], lr=0.02, weight_decay=0.1, momentum=0.9, ns_dtype=torch.bfloat16)
        for grad in grad_seq:
            p.grad = grad.clone()
            opt.step()
        return p.detach()

    base = run(grads)
    perturbed = [grad.clone() for grad in grads]
    for grad in perturbed:
        grad[1] += 10 * torch.randn(m, n)  # only expert 1's gradient changes
    other = run(perturbed)
    assert torch.equal(base[0], other[0]) and torch.equal(base[2], other[2])
    assert not torch.equal(base[1], other[1])

    # Each slice moves as torch's Muon (bf16 Newton-Schulz) moves a 2-D parameter holding that expert alone.
    for e in range(E):
        p = torch.nn.Parameter(init[e].clone())
        opt = torch.optim.Muon([p], lr=0.02, weight_decay=0.1, momentum=0.9)
        for grad in grads:
            p.grad = grad[e].clone()
            opt.step()
        _same_update(base[e], p.detach(), init[e], e)


def test_batched_muon_equals_torch_muon_on_mixed_shapes():
    """Matrices of equal shape are orthogonalised together; each still moves exactly as under torch.optim.Muon."""
    torch.manual_seed(1)
    shapes = [(6, 4), (6, 4), (4, 9), (6, 4), (9, 4)]
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]

    def run(make):
        params = [torch.nn.Parameter(w.clone()) for w in init]
        opt = make(params)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params]

    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    ours = run(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw))
    theirs = run(lambda ps: torch.optim.Muon(ps, **kw))
    for i, (a, b, w) in enumerate(zip(ours, theirs, init, strict=True)):
        _same_update(a, b, w, i)
    # fp32 Newton-Schulz (the CPU default): the same iteration, so it differs from bf16 only by bf16 rounding
    fp32 = run(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw))
    for a, b, w in zip(fp32, theirs, init, strict=True):
        assert not torch.equal(a, b)
        torch.testing.assert_close(a - w, b - w, rtol=0.05, atol=3 * 0.02 * 0.02)


def test_batched_newton_schulz_equals_one_matrix_at_a_time(model):
    torch.manual_seed(2)
    for m, n in [(5, 7), (7, 5)]:
        g = torch.randn(4, m, n)
        batched = batched_newton_schulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
        for i in range(4):
            one = batched_newton_schulz(g[i : i + 1], (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
            torch.testing.assert_close(batched[i], one[0], rtol=1e-5, atol=1e-6)
    optimizers, _ = build_optimizer(model, OptimConfig())
    assert optimizers["muon"].param_groups[0]["ns_dtype"] == torch.float32  # auto: fp32 off CUDA


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_values(schedule):
    cfg = OptimConfig(warmup_steps=10, total_steps=110, schedule=schedule, min_lr_ratio=0.1)
    assert lr_lambda(0, cfg) == pytest.approx(0.1)
    assert lr_lambda(4, cfg) == pytest.approx(0.5)
    assert lr_lambda(10, cfg) == pytest.approx(1.0)
    mid = {"cosine": 0.55, "linear": 0.55, "constant": 1.0}[schedule]
    assert lr_lambda(60, cfg) == pytest.approx(mid)
    quarter = {"cosine": 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), "linear": 0.775, "constant": 1.0}
    assert lr_lambda(35, cfg) == pytest.approx(quarter[schedule])
    end = 1.0 if schedule == "constant" else 0.1
    assert lr_lambda(110, cfg) == pytest.approx(end)
    assert lr_lambda(500, cfg) == pytest.approx(end)


def test_schedulers_scale_each_optimizer_peak(model):
    cfg = OptimConfig(lr=1e-3, muon_lr=2e-2, warmup_steps=4, total_steps=8)
    optimizers, _ = build_optimizer(model, cfg)
    sched = Schedulers(optimizers, cfg)
    assert sched.last_lrs() == pytest.approx({"muon": 5e-3, "muon_experts": 5e-3, "adamw": 2.5e-4})
    for _ in range(3):
        for opt in optimizers.values():
            opt.step()  # no gradients: a no-op, in the order LambdaLR expects
        sched.step()
    assert sched.last_lrs() == pytest.approx({"muon": 2e-2, "muon_experts": 2e-2, "adamw": 1e-3})
    state = sched.state_dict()
    again = Schedulers(build_optimizer(model, cfg)[0], cfg)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_clip_grad_norm_is_global():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((2, 2), 3.0)
    total = clip_grad_norm([a, b], 1.0)
    assert total.item() == pytest.approx(math.sqrt(3 * 4 + 4 * 9))
    clipped = torch.cat([a.grad.flatten(), b.grad.flatten()]).norm()
    assert clipped.item() == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm([a, b], 0.0).item() == pytest.approx(clipped.item())  # 0: measure only


def test_config_errors():
    with pytest.raises(pydantic.ValidationError, match="unknown"):
        OptimConfig(unknown=1)
    with pytest.raises(pydantic.ValidationError, match="warmup_steps=20 exceeds total_steps=10"):
        OptimConfig(warmup_steps=20, total_steps=10)
    with pytest.raises(pydantic.ValidationError, match="schedule"):
        OptimConfig(schedule="step")
    assert OptimConfig.model_fields["min_lr_ratio"].description  # field docstrings are kept
