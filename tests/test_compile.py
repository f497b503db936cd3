"""Per-layer torch.compile changes speed, not math: compiled == eager over changing packings, with no recompiles.

The matrix runs one eager and one compiled model side by side over micro-batches packing 1, 2, 4, 1, 3 sequences,
without and with activation checkpointing, and compares logits, the gradient at the input embeddings, every
parameter gradient, and the parameters after an AdamW step.

Backends: the default run uses "aot_eager", which goes through everything that can recompile or break parity in
our code (dynamo's tracing, guards and graph breaks at the opaque ops, AOTAutograd's joint forward/backward graphs
and their dynamic shapes) but runs the captured aten graphs without generating C++; the inductor case (code
generation for the same graphs, minutes on 2 cores) is marked slow and also run by `benchmarks/compile_packed.py`.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from flashnext.activation_checkpoint import apply_activation_checkpointing
from flashnext.compile import compile_model, mark_dynamic_batch
from flashnext.config import TextConfig
from flashnext.errors import ConfigError
from flashnext.model.text import FlashNextForCausalLM

COUNTS = [1, 2, 4, 1, 3]
WARMUP = 2  # the first single-sequence and the first multi-sequence step may compile
RTOL, ATOL = 2e-4, 2e-5


def _two_layers(cfg: dict) -> dict:
    """The small config cut to one layer of each kind (GDN with PLE, QSA): compile time grows with the number of
    distinct layer structures (equal layers share graphs), and these two hold every opaque op and graph break."""
    return {
        **cfg,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "indexed_attention"],
        "ple_layer_ids": [1],
    }


def _model(cfg: dict) -> FlashNextForCausalLM:
    m = FlashNextForCausalLM(TextConfig.from_dict(cfg))
    m.init_weights(seed=0)
    with torch.no_grad():  # init leaves norms at identity and the PLE conv at zero, which would hide bugs
        gen = torch.Generator().manual_seed(1)
        for name, p in m.named_parameters():
            if "norm" in name or "conv" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return m


def _batches(vocab: int):
    gen = torch.Generator().manual_seed(2)
    out = []
    for n in COUNTS:
        lengths = torch.randint(5, 25, (n,), generator=gen)  # >= 5: T == 1 would (rightly) get its own graph
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        out.append((torch.randint(0, vocab, (int(cu[-1]),), generator=gen), cu))
    return out


def _step(model, opt, ids, cu, compiled):
    """One training step; returns logits, the input-embedding grad, parameter grads and updated parameters."""
    ids, cu, labels = ids.clone(), cu.clone(), ids.clone()
    if compiled:
        mark_dynamic_batch(ids, cu, None, labels)
    emb = {}

    def keep(module, args, out):
        out.retain_grad()
        emb["out"] = out

    handle = model.model.embed_tokens.register_forward_hook(keep)
    try:
        out = model(ids, cu_seqlens=cu, labels=labels)
    finally:
        handle.remove()
    out.loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(logits=out.logits.detach(), emb_grad=emb["out"].grad, grads=grads, params=params)


def _run(cfg, backend, checkpointing):
    eager, compiled = _model(cfg), _model(cfg)
    compile_model(compiled, backend=backend)
    if checkpointing:
        apply_activation_checkpointing(eager)
        apply_activation_checkpointing(compiled)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, compiled)}
    steps = []
    for i, (ids, cu) in enumerate(_batches(cfg["vocab_size"])):
        if i == WARMUP:
            frames = counters["frames"]["total"]
        steps.append(
            (_step(eager, opts[id(eager)], ids, cu, False), _step(compiled, opts[id(compiled)], ids, cu, True))
        )
    return steps, counters["frames"]["total"] - frames


_RUNS: dict = {}


def _matrix(cfg: dict, backend: str) -> dict:
    """Both checkpointing variants of a backend, run once per session and shared by the tests below."""
    if backend not in _RUNS:
        torch._dynamo.reset()
        _RUNS[backend] = {ac: _run(_two_layers(cfg), backend, ac) for ac in (False, True)}
    return _RUNS[backend]


BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ac"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_matches_eager(small_config, backend, checkpointing):
    steps, _ = _matrix(small_config, backend)[checkpointing]
    for i, (eager, comp) in enumerate(steps):
        where = f"step {i} ({COUNTS[i]} seqs)"
        _close(comp["logits"], eager["logits"], f"{where} logits")
        _close(comp["emb_grad"], eager["emb_grad"], f"{where} input-embedding grad")
        assert comp["grads"].keys() == eager["grads"].keys()
        for name, g in eager["grads"].items():
            if g is None:  # the frozen-by-construction QSA indexer (its selection is discrete)
                assert comp["grads"][name] is None, f"{where} {name}"
            else:
                _close(comp["grads"][name], g, f"{where} grad {name}")
        for name, p in eager["params"].items():
            _close(comp["params"][name], p, f"{where} AdamW-updated {name}")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ac"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_recompiles_after_warmup(small_config, backend, checkpointing):
    _, recompiles = _matrix(small_config, backend)[checkpointing]
    assert recompiles == 0


def test_compile_keeps_names_and_refuses_checkpointed_model(small_config):
    plain, compiled = _model(small_config), _model(small_config)
    n = compile_model(compiled, backend="aot_eager")
    assert n == len(compiled.model.layers) + 1  # + the final stream mixer
    assert compile_model(compiled, backend="aot_eager") == 0  # idempotent
    assert list(compiled.state_dict()) == list(plain.state_dict())
    apply_activation_checkpointing(plain)
    with pytest.raises(ConfigError, match="before apply_activation_checkpointing"):
        compile_model(plain)


def _specialises_on_one_sequence(ids, cu):
    """Stands for a path that reads cu_seqlens' size (as the anchor trainer's n-gram path did)."""
    if cu.shape[0] == 2:
        return ids * 2
    return ids + cu[1:].sum()


@pytest.mark.parametrize("order", [(3, 1, 2), (1, 4, 1)], ids=["multi-then-single", "single-then-multi"])
def test_single_sequence_after_multi_raises_no_constraint_violation(order):
    fn = torch.compile(_specialises_on_one_sequence, backend="eager")
    for n in order:
        ids, cu = torch.arange(5 * n), torch.arange(n + 1, dtype=torch.int32) * 5
        mark_dynamic_batch(ids, cu)
        torch.testing.assert_close(fn(ids, cu), _specialises_on_one_sequence(ids, cu))
    # The strict marking is what failed: a dim marked dynamic that the trace specialises raises.
    strict = torch.compile(_specialises_on_one_sequence, backend="eager")
    ids, cu = torch.arange(5), torch.tensor([0, 5], dtype=torch.int32)
    torch._dynamo.mark_dynamic(cu, 0)
    with pytest.raises(Exception, match="Constraint|specializ"):
        strict(ids, cu)
