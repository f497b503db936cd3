"""Serving fast paths of the model layers against their plain twins: fused projections, skinny GEMMs, MoE.

The fast paths are explicit: a `Group` computes its members separately unless called with `fused=True`, and fused
weights exist only after `prepare` (what `serve.prepare_for_inference` does)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_moe import _cfg
from torch import nn

from flashnext.model import fused
from flashnext.model.moe import Experts, Router, SparseMoE
from flashnext.model.state import DECODE, Step


def _linears(bias: bool) -> tuple[nn.Module, ...]:
    torch.manual_seed(0)
    mods = (nn.Linear(12, 7, bias=bias), nn.Linear(12, 1, bias=False), Router(_cfg(E=5)), nn.Linear(12, 30, bias=bias))
    mods[2].weight = nn.Parameter(torch.randn(5, 12))
    return tuple(m.double() for m in mods)


def _separate(x, mods):
    return [F.linear(x, m.weight, getattr(m, "bias", None)) for m in mods]


def _group(bias: bool) -> tuple[fused.Group, tuple[nn.Module, ...]]:
    mods = _linears(bias)
    group = fused.Group(*mods)
    group.build()
    return group, mods


@pytest.mark.parametrize("rows", [1, 16, 100], ids=["one", "skinny", "wide"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_group_equals_separate_linears(rows, bias):
    group, mods = _group(bias)
    x = torch.randn(rows, 12, dtype=torch.float64)
    with torch.no_grad():
        got = group(x, fused=True)
    for a, b in zip(got, _separate(x, mods), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])
def test_plain_path_calls_each_module(grad):
    """The plain path (training, and any forward without serving state, with or without autograd): every
    nn.Linear runs as a module call (hooks, FLOP attribution, FSDP), no fused weight is needed or read."""
    mods = _linears(True)
    group = fused.Group(*mods)  # never built: a fused call would raise
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=grad)
    calls = []
    for m in mods:
        m.register_forward_hook(lambda mod, *_: calls.append(mod))
    with torch.set_grad_enabled(grad):
        out = group(x)
    assert calls == [m for m in mods if isinstance(m, nn.Linear)]
    for a, b in zip(out, _separate(x, mods), strict=True):
        assert torch.equal(a, b)
    if grad:
        sum(o.sum() for o in out).backward()
        assert all(m.weight.grad is not None for m in mods)
    with pytest.raises(RuntimeError, match="prepare_for_inference"):
        group(x.detach(), fused=True)


def test_prepare_builds_every_group_of_a_model(small_config):
    """`prepare` finds the layers' groups: per layer its mixer's, two hyper-connections' and the MoE's; per PLE
    part one; and the final stream mixer's."""
    from flashnext.config import parse_config
    from flashnext.model.text import FlashNextForCausalLM

    model = FlashNextForCausalLM(parse_config(small_config).text)
    cfg = model.config
    expected = cfg.num_hidden_layers * 4 + len(cfg.ple_layer_ids) + 1  # mixer, 2 hyper, MoE; PLE; final mixer
    assert fused.prepare(model) == expected
    assert all(g._built is not None for g in fused.groups(model))


def test_fused_weight_follows_in_place_updates():
    """The concatenated weight is rebuilt after an optimizer step, a load_state_dict or a `.data` swap."""
    group, mods = _group(True)
    x = torch.randn(3, 12, dtype=torch.float64)

    def check():
        with torch.no_grad():
            got = group(x, fused=True)
        for a, b in zip(got, _separate(x, mods), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    check()
    address = group.weights()[0].data_ptr()
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.5)
    sum(o.sum() for o in _separate(x, mods)).backward()
    opt.step()
    check()
    state = {k: torch.randn_like(v) for k, v in mods[0].state_dict().items()}
    mods[0].load_state_dict(state)
    check()
    assert group.weights()[0].data_ptr() == address  # rebuilt in place: a captured CUDA graph reads it there
    mods[3].weight.data = torch.randn(30, 12, dtype=torch.float64)
    check()
    mods[1].weight = nn.Parameter(torch.randn(1, 12, dtype=torch.float64))  # a new Parameter object
    check()


@pytest.mark.parametrize("contiguous", [True, False])
def test_skinny_linear_equals_f_linear(contiguous):
    """A weight past `SMALL_WEIGHT` (fp64 300 x 80: 192 KB) takes `(W @ x.T).T` up to `SKINNY_ROWS` rows (the
    transposed view itself where the caller allows it); a cache-sized one (300 x 40: 96 KB) is `F.linear` itself."""
    for features in (80, 40):
        w, b = torch.randn(300, features, dtype=torch.float64), torch.randn(300, dtype=torch.float64)
        small = features == 40
        assert small == (w.numel() * w.element_size() <= fused.SMALL_WEIGHT)  # the two sizes straddle the bound
        for rows in (1, 5, fused.SKINNY_ROWS, fused.SKINNY_ROWS + 1):
            x = torch.randn(rows, features, dtype=torch.float64)
            with torch.no_grad():
                got = fused.linear(x, w, b, fused=True, contiguous=contiguous)
            transposed = not small and 1 < rows <= fused.SKINNY_ROWS and not contiguous
            assert got.is_contiguous() != transposed
            if small:
                assert torch.equal(got, F.linear(x, w, b))
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-12, atol=1e-12)


def _graph_ops(fn, *args):
    """fn compiled by dynamo without code generation: (its output, the ops of the traced graph, its inputs)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()  # the callers' lambdas are one code object per call site: no stale cache entries
    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    gm, inputs = graphs[0]
    return out, {str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}, inputs


@pytest.mark.parametrize(
    ("dtype", "native"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["fp32", "bf16", "bf16_avx2_cpu"],
)
def test_compiled_few_row_product_is_a_reduction_equal_to_f_linear(dtype, native, monkeypatch):
    """Inside a compiled graph a product of at most `fused.REDUCED_ROWS` rows is a reduction in fp32
    (`fused.reduced_linear`); more rows stay a GEMM; on a CPU without bf16 instructions (`fused.NATIVE_GEMM`) only
    one row reduces. fp32 sums of 256 unit-variance products (outputs up to ~50, ulp ~4e-6) in another order than
    MKL: 1e-4 absolute (a few ulps; 1e-5 failed on one draw); bf16 rounds once at the end in both (fp32
    accumulation), so the two differ by at most one bf16 rounding step: 1e-2 relative."""
    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, native)
    most = fused.REDUCED_ROWS if native else 1
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 256, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    for rows in (1, 3, fused.REDUCED_ROWS, fused.REDUCED_ROWS + 1):
        x = torch.randn(rows, 256, generator=g).to(dtype)
        got, ops, _ = _graph_ops(lambda x: fused.linear(x, w, b, fused=True), x)
        torch.testing.assert_close(got, F.linear(x, w, b), **tol)
        reduced = any("sum" in op for op in ops) and not any(op.endswith(("mm", "linear")) for op in ops)
        assert reduced == (rows <= most), (rows, ops)


@pytest.mark.slow
def test_reduced_product_under_inductor_equals_f_linear():
    """The generated code (inductor) of the reduction, fp32 and bf16 weights, 1, 4 and REDUCED_ROWS rows; 320
    outputs (fp32: summed over weight tiles from 2 rows) and 300 (not a whole number of tiles: row by row)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for n in (320, 300):
            w, b = torch.randn(n, 200, dtype=dtype), torch.randn(n, dtype=dtype)
            compiled = torch.compile(lambda x, w=w, b=b: fused.linear(x, w, b, fused=True), fullgraph=True,
                                     dynamic=False)  # fmt: skip
            for rows in (1, 4, fused.REDUCED_ROWS):
                x = torch.randn(rows, 200, dtype=dtype)
                with torch.no_grad():
                    torch.testing.assert_close(compiled(x), F.linear(x, w, b), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 2, fused.REDUCED_ROWS])
def test_several_rows_of_an_fp32_product_are_summed_over_weight_tiles(rows):
    """From 2 rows, a traced fp32 product of a whole number of `REDUCED_TILE`-row tiles views the weight as tiles
    (the permute of the tile sums back to [M, N] is the mark); one row, a bf16 weight or a ragged N does not. Sums
    of 200 fp32 terms in another lane order: fp32 rounding of F.linear."""
    w = torch.randn(3 * fused.REDUCED_TILE, 200)
    x = torch.randn(rows, 200)
    for weight, tiled in ((w, rows > 1), (w[:-1], False), (w.bfloat16(), False)):
        inp = x.to(weight.dtype)
        out, ops, _ = _graph_ops(lambda x, weight=weight: fused.reduced_linear(x, weight), inp)
        assert ("permute" in ops) == tiled, (weight.shape, weight.dtype, ops)
        if weight.dtype == torch.float32:
            torch.testing.assert_close(out, F.linear(inp, weight), rtol=1e-5, atol=1e-5)


def test_compiled_group_product_reads_the_bf16_weight_not_its_fp32_copy(monkeypatch):
    """A group's fp32 copy serves eager few-row products; inside a compiled graph the reduction reads the bf16
    weight itself (half the bytes) and upcasts as it reads (two rows: a CPU with bf16 instructions)."""
    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, True)
    mods = [nn.Linear(64, 32, dtype=torch.bfloat16), nn.Linear(64, 16, dtype=torch.bfloat16)]
    group = fused.Group(*mods)
    group.build()
    assert group._fp32 is not None
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    (a, b), ops, inputs = _graph_ops(lambda x: group(x, fused=True), x)
    ref = [F.linear(x.float(), m.weight.float(), m.bias.float()) for m in mods]
    # fp32 sums of 64 terms in another order, then one rounding each: at most one bf16 step apart (2^-8 relative)
    torch.testing.assert_close(a.float(), ref[0], rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(b.float(), ref[1], rtol=2**-7, atol=1e-2)
    assert not any(op.endswith("mm") for op in ops), ops
    weights = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == 64]
    assert weights and all(t.dtype == torch.bfloat16 for t in weights), [(t.shape, t.dtype) for t in weights]


def test_compiled_group_product_on_a_cpu_without_bf16_instructions_is_an_fp32_gemm(monkeypatch):
    """Without bf16 instructions (`fused.NATIVE_GEMM`) a compiled group product of a few rows (more than one) is one
    fp32 GEMM on the group's fp32 copy: not the bf16 reduction, and not a reduction over the copy either (both read
    the weight once per row: a batch-4 bf16 decode step 7.6 against 5.4 ms on an AVX2 EPYC)."""
    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, False)
    mods = [nn.Linear(64, 32, dtype=torch.bfloat16), nn.Linear(64, 16, dtype=torch.bfloat16)]
    group = fused.Group(*mods)
    group.build()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    (a, b), ops, inputs = _graph_ops(lambda x: group(x, fused=True), x)
    assert any(" mm " in op for op in ops) and not any("sum" in op for op in ops), ops  # torch.mm, no sum
    weights = [t for t in inputs if isinstance(t, torch.Tensor) and t.shape == (48, 64)]  # the fused weight
    assert weights and all(t.dtype == torch.float32 for t in weights), [(t.shape, t.dtype) for t in weights]
    for got, m in ((a, mods[0]), (b, mods[1])):  # fp32 sums of 64 terms in another order, one rounding each
        torch.testing.assert_close(
            got.float(), F.linear(x.float(), m.weight.float(), m.bias.float()), rtol=2**-7, atol=1e-2
        )


@pytest.mark.parametrize("T", [1, 3, 40])
def test_moe_serving_path_equals_training_path(T):
    """SparseMoE's fused path (router/shared projections as one GEMM, transposed expert GEMMs) == the plain path."""
    torch.manual_seed(3)
    moe = SparseMoE(_cfg(E=6, k=2)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    fused.prepare(moe)
    x = torch.randn(T, 8, dtype=torch.float64)
    with torch.no_grad():
        out, experts = moe(x, step=Step(DECODE))
    ref, ref_experts = moe(x.clone().requires_grad_())
    # The expert choice is discrete, from router logits that the two paths compute with different GEMMs (one
    # concatenated with the shared expert's, or alone) and the router ranks as fp32 probabilities: rounding can
    # only swap experts whose probabilities tie to a few fp32 ulps. With no near-tie among the top k + 1, the
    # choice (and its order) is equal.
    with torch.no_grad():
        top = torch.softmax(F.linear(x, moe.gate.weight), -1, dtype=torch.float).topk(3, dim=-1).values
    assert float((top[:, :-1] - top[:, 1:]).min()) > 1e-5
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [1, 7, 16, 17])
def test_transposed_expert_gemms_equal_plain(rows):
    torch.manual_seed(4)
    gate_up, down = torch.randn(5, 10, 8, dtype=torch.float64), torch.randn(5, 8, 5, dtype=torch.float64)
    x = torch.randn(5, rows, 8, dtype=torch.float64)
    with torch.no_grad():
        got = Experts._swiglu(x, gate_up, down, fused=True)
    gate, up = (x @ gate_up.transpose(1, 2)).chunk(2, dim=-1)
    torch.testing.assert_close(got, (F.silu(gate) * up) @ down.transpose(1, 2), rtol=1e-12, atol=1e-12)


class _MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the input dtype of every matrix product dispatched."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "linear", "matmul", "bmm", "baddbmm"):
            self.dtypes.append(args[1].dtype if name in ("addmm", "baddbmm") else args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("native", [True, False], ids=["bf16_cpu", "avx2_cpu"])
@pytest.mark.parametrize("rows", [1, 16])
def test_small_bf16_linears_use_their_fp32_copy(rows, native, monkeypatch):
    """bf16 serving on CPU: a small weight (a group's, or a single nn.Linear served by `apply_linear`) multiplies
    few rows through its fp32 copy (`fused.FP32_COPY_MAX`), more rows in bf16 on a CPU with bf16 instructions,
    through the copy at any row count on one without (`fused.NATIVE_GEMM`); all equal the plain bf16 module
    call within one bf16 rounding at the outputs' scale (~1 here: rtol = atol = 2**-7, one bf16 ulp; the kernels
    accumulate in another order and the bf16 ones may round partial sums, which can flip a rounding, seen up to
    2**-8), and follow an in-place weight update."""
    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, native)
    torch.manual_seed(5)
    model = nn.ModuleDict(
        {"single": nn.Linear(256, 256), "a": nn.Linear(256, 300, bias=False), "b": nn.Linear(256, 200)}
    ).bfloat16()
    model.group = fused.Group(model["a"], model["b"])
    fused.prepare(model)
    x = torch.randn(rows, 256).bfloat16()

    def check(fp32: bool):
        with torch.no_grad(), _MatmulDtypes() as seen:
            single = fused.apply_linear(model["single"], x, fused=True)
            a, b = model.group(x, fused=True)
        assert seen.dtypes == [torch.float32 if fp32 else torch.bfloat16] * 2
        assert single.is_contiguous()
        with torch.no_grad():
            for got, m in ((single, model["single"]), (a, model["a"]), (b, model["b"])):
                assert got.dtype == torch.bfloat16
                torch.testing.assert_close(got, m(x), rtol=2**-7, atol=2**-7)

    fp32 = rows * 256 * 256 <= fused.FP32_COPY_MAX or not native
    assert (rows * 256 * 256 <= fused.FP32_COPY_MAX) == (rows * 500 * 256 <= fused.FP32_COPY_MAX)  # same side here
    check(fp32)
    with torch.no_grad():
        model["single"].weight.mul_(-2)  # in place (an optimizer step, a weight sync)
        model["b"].bias.add_(1)
    check(fp32)


@pytest.mark.parametrize("T", [1, 40], ids=["gathered", "grouped"])
def test_bf16_serving_products_run_in_fp32_on_a_cpu_without_bf16_instructions(T, monkeypatch):
    """Where the CPU has no bf16 instructions (`fused.NATIVE_GEMM`: oneDNN emulates them there, ~8x slower than
    fp32), every serving product of a bf16 MoE layer runs in fp32: the fused router/shared GEMM (its fp32 copy),
    the shared expert's down projection, the experts (gathered or grouped slab) and a weight too large for a copy
    (upcast per call); with the instructions, the large ones stay bf16. Both equal the fp64 computation from the
    same bf16 weights within bf16 rounding at the outputs' scale (atol = 2**-6 x the largest output, ~2 bf16 ulps
    of it: each product's output and the intermediates (routing weights, the shared expert's hidden) round to
    bf16; measured up to 2**-7.6 over 10 seeds), with the same experts chosen."""
    torch.manual_seed(6)
    moe = SparseMoE(_cfg(E=6, k=2)).bfloat16()
    big = nn.Linear(8, 1 << 16, bias=False).bfloat16()  # 2^19 elements: no fp32 copy
    for p in [*moe.parameters(), big.weight]:
        torch.nn.init.normal_(p, std=0.5)
    fused.prepare(moe)
    x = torch.randn(T, 8).bfloat16()
    with torch.no_grad():
        ref, ref_experts = moe.double()(x.double(), step=Step(DECODE))
        ref_big = F.linear(x.double(), big.weight.double())
    moe.bfloat16()
    fused.prepare(moe)
    for native in (False, True):
        monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, native)
        with torch.no_grad(), _MatmulDtypes() as seen:
            out, experts = moe(x, step=Step(DECODE))
            out_big = fused.linear(x, big.weight, fused=True)
        assert out.dtype == out_big.dtype == torch.bfloat16
        assert (torch.bfloat16 in seen.dtypes) == native, seen.dtypes
        assert torch.equal(experts, ref_experts)
        for got, want in ((out, ref), (out_big, ref_big)):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2**-6 * float(want.abs().max()))


def test_fp32_copies_only_for_small_low_precision_cpu_weights():
    model = nn.ModuleDict({"small": nn.Linear(64, 64), "big": nn.Linear(1024, 1024)}).bfloat16()
    model["fp32"] = nn.Linear(64, 64)
    fused.prepare(model)
    assert fused.SINGLE in vars(model["small"])
    assert fused.SINGLE not in vars(model["big"]) and fused.SINGLE not in vars(model["fp32"])
    assert vars(model["small"])[fused.SINGLE]._fp32[0].dtype == torch.float32


def test_watch_rebuilds_exactly_the_changed_groups():
    """`fused.Watch` (the decode graph's check before each call): nothing rebuilt while nothing changed; an in-place
    update, a new storage (`.data =`) and a new Parameter object each rebuild their group, and only it."""
    a, b = [nn.Linear(8, 4, dtype=torch.float64) for _ in range(2)], [nn.Linear(8, 3, dtype=torch.float64)]
    groups = [fused.Group(*a), fused.Group(*b)]
    for g in groups:
        g.build()
    watch = fused.Watch(groups)
    assert watch.refresh() == 0 and watch.refresh() == 0
    x = torch.randn(2, 8, dtype=torch.float64)

    def check():
        for g in groups:
            got, want = g.product(x), torch.cat([F.linear(x, m.weight, m.bias) for m in g.members], -1)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # fp64, another GEMM's sum order

    with torch.no_grad():
        a[1].weight.mul_(2.0)
    assert watch.refresh() == 1
    check()
    b[0].bias.data = torch.randn(3, dtype=torch.float64)
    assert watch.refresh() == 1
    a[0].weight = nn.Parameter(torch.randn(4, 8, dtype=torch.float64))
    assert watch.refresh() == 1
    check()
    assert watch.refresh() == 0


@pytest.mark.parametrize(
    ("rows", "dtype", "op"),
    [
        (4, torch.bfloat16, " mm "),
        (16, torch.bfloat16, " mm "),
        (32, torch.bfloat16, " mm "),
        (32, torch.float32, "linear"),
    ],
)
def test_compiled_products_above_graph_row_major_are_plain_linears(monkeypatch, rows, dtype, op):
    """Inside a compiled graph a product of more than `GRAPH_ROW_MAJOR` rows is `F.linear` (x row-major, as every
    other reader of x wants it), of fewer rows (a bf16 product on a CPU without bf16 instructions) the transposed
    `W @ x.T`; a bf16 input's fp32 upcast, read by this product alone, keeps `W @ x.T` above the bound too. All
    equal `F.linear` to fp32 rounding (bf16: one rounding of the result)."""
    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, False)
    w = torch.randn(48, 64).to(dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    y, ops, _ = _graph_ops(lambda x: fused.linear(x, w, fused=True), x)
    assert any(op in o for o in ops), ops
    assert not (op == " mm " and any("linear" in o for o in ops)), ops
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("native", [True, False], ids=["bf16_cpu", "avx2_cpu"])
def test_compiled_ngram_lookup_feeding_a_reduced_product_is_embedding_bag(small_config, native, monkeypatch):
    """Inside a compiled inference graph, the n-gram rows of a 16-bit table whose PLE product will reduce
    (`fused.reduced`: one row on a CPU without bf16 instructions, up to `REDUCED_ROWS` with them) are read by
    `embedding_bag` (a kernel of its own; inductor inlined `embedding` into the product's loop); elsewhere by
    the table module. Either way the rows themselves, bitwise (a gather; one row summed onto zero)."""
    from flashnext.config import parse_config
    from flashnext.model.ngram import NGramEmbedding

    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, native)
    torch.manual_seed(0)
    emb = NGramEmbedding(parse_config(small_config).text, 0)
    n = emb.ngram_embedding.num_embeddings
    for dtype in (torch.bfloat16, torch.float32):
        emb.to(dtype)
        for T in (1, 3, fused.REDUCED_ROWS + 1):
            rows = torch.randint(0, n, (T, emb.num_heads))
            got, ops, _ = _graph_ops(emb._lookup, rows)
            assert torch.equal(got, emb.ngram_embedding(rows))
            bag = dtype == torch.bfloat16 and T <= (fused.REDUCED_ROWS if native else 1)
            assert any("embedding_bag" in op for op in ops) == bag, (dtype, T, ops)
    with torch.enable_grad():  # a training graph keeps the module call (its backward, hooks)
        graphs = []
        torch._dynamo.reset()
        torch.compile(emb._lookup, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(rows[:1])
        assert not any("embedding_bag" in str(nd.target) for nd in graphs[0].graph.nodes)


@pytest.mark.parametrize(
    ("dtype", "native"),
    [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)],
    ids=["bf16", "bf16_avx2_cpu", "fp32"],
)
def test_frozen_graph_products_of_native_16bit_weights_are_linear_on_them(dtype, native, monkeypatch):
    """Traced for a frozen graph (`fused.frozen_products`), a group product of 16-bit weights the CPU has
    instructions for (`fused.frozen_native`) is `F.linear` on the 16-bit weight at 1 and 2 rows: neither a reduction
    (its upcast would fold into an fp32 constant) nor the fp32 copy. Without them (an AVX2 CPU) one row reduces and
    two multiply the fp32 copy; fp32 weights: one row reduces, two are `F.linear`. Tolerance as in the few-row test
    above: fp32 sums in another order; bf16 results one rounding apart at most."""
    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, native)
    g = torch.Generator().manual_seed(0)
    mods = [nn.Linear(64, 32, dtype=dtype), nn.Linear(64, 16, dtype=dtype)]
    group = fused.Group(*mods)
    group.build()
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
    for rows in (1, 2):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        with fused.frozen_products():
            (a, b), ops, inputs = _graph_ops(lambda x: group(x, fused=True), x)
        assert not fused._frozen()  # the context is left as it was
        ref = [F.linear(x.float(), m.weight.float(), m.bias.float()) for m in mods]
        torch.testing.assert_close(a.float(), ref[0], **tol)
        torch.testing.assert_close(b.float(), ref[1], **tol)
        reduces = rows == 1 and not (native and dtype == torch.bfloat16)
        assert any("sum" in op for op in ops) == reduces, (rows, ops)
        assert any("linear" in op for op in ops) == (not reduces), (rows, ops)
        weights = {t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.shape == (48, 64)}  # fused weight
        copy = dtype == torch.bfloat16 and not native and rows == 2  # the AVX2 CPU's fp32 copy
        assert weights == {torch.float32 if copy else dtype}, (rows, weights)
