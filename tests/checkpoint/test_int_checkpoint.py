"""int8 / int4 checkpoints on disk: `quantize --weights int8|int4` writes codes + scales, `from_pretrained` builds the
quantized modules from them (no float copy of a quantized part), bitwise equal to `quantize_model` of the float
checkpoint, and what is malformed is refused by key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from ckpt_helpers import TINY_VISION, headers, rewrite
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import flashnext
from flashnext.checkpoint import save_pretrained
from flashnext.checkpoint.int_weights import pack_nibbles, unpack_nibbles
from flashnext.cli import main as cli_main
from flashnext.config import parse_config
from flashnext.errors import CheckpointError, ConfigError
from flashnext.model.moe import Experts
from flashnext.model.text import FlashNextForCausalLM
from flashnext.quant.apply import QuantScheme, quantize_model
from flashnext.quant.int_experts import QuantExperts
from flashnext.quant.int_linear import Int8Group, Int8Linear
from flashnext.quant.int_quantize import quantize_int

# As tests/quant/test_apply.py: hidden and 2 x width multiples of 16, width a multiple of the int4 group.
OVERRIDES = dict(vocab_size=256, hidden_size=64, num_experts=8, moe_intermediate_size=64,
                 shared_expert_intermediate_size=32, num_hidden_layers=2, ple_layer_ids=[1],
                 layer_types=["linear_attention", "indexed_attention"], mtp_num_hidden_layers=1)  # fmt: skip
SCHEMES = {"int8": QuantScheme.from_flags("int8"), "int4": QuantScheme.from_flags("int4", group=32)}
EXPERT = "model.layers.1.mlp.experts.3"
LINEAR = "model.layers.0.linear_attn.in_proj_z"


pytestmark = pytest.mark.usefixtures("one_thread")


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, small_config_module):
    """{"bf16": the float source (two files + index), "int8": its int8 copy, "int4": int4 experts g32 + int8 trunk}."""
    root = tmp_path_factory.mktemp("int")
    model = _perturbed(FlashNextForCausalLM(parse_config({**small_config_module, **OVERRIDES}).text))
    save_pretrained(model.to(torch.bfloat16), root / "bf16", max_shard_bytes=400_000)
    (root / "bf16" / "tokenizer_config.json").write_text("{}\n")
    out = {"bf16": root / "bf16"}
    for name, scheme in SCHEMES.items():
        quantize_int(root / "bf16", root / name, scheme)
        out[name] = root / name
    return out


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_loaded_int_checkpoint_is_quantize_model_of_the_float_one_bitwise(ckpts, weights):
    """Bitwise by construction: the writer made the codes with the functions `quantize_model` calls (per row, so
    quantising gate and up apart equals quantising `gate_up` whole), and the same kernels run them."""
    loaded = flashnext.from_pretrained(ckpts[weights], dtype=torch.float32)
    direct = quantize_model(flashnext.from_pretrained(ckpts["bf16"], dtype=torch.float32), SCHEMES[weights])
    assert not any(isinstance(m, torch.nn.Linear | Experts) for m in loaded.modules())
    assert isinstance(loaded.model.layers[0].linear_attn.in_proj, Int8Group)
    assert isinstance(loaded.mtp.layers[0].mlp.experts, QuantExperts)
    assert loaded.model.layers[0].mlp.experts.scheme == weights
    want = dict(direct.state_dict())
    got = dict(loaded.state_dict())
    assert got.keys() == want.keys()
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, direct(_ids()).logits)
    assert loaded.stored_quant == SCHEMES[weights]


@pytest.mark.parametrize("route", ["disk", "memory"])
def test_saving_a_quantized_model_is_refused_and_writes_nothing(ckpts, tmp_path, route):
    """The int modules' buffers are packed kernel layouts, not the int checkpoint's format: `save_pretrained` wrote
    them under their module names into a checkpoint nothing could load; now it refuses, naming a module."""
    if route == "disk":
        model = flashnext.from_pretrained(ckpts["int8"], dtype=torch.bfloat16)
    else:
        model = quantize_model(flashnext.from_pretrained(ckpts["bf16"], dtype=torch.bfloat16), SCHEMES["int4"])
    with pytest.raises(CheckpointError, match="weight-only int8/int4 modules"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_int4_codes_are_nibble_packed_low_first_on_disk(ckpts):
    """The documented portable layout: plain row-major codes, code 2j in the low nibble of byte j; scales/zeros
    [N, K/g] with w = (q - 8) * scale + zero."""
    from safetensors import safe_open

    from flashnext.quant.int_experts import dequantize_int4, quantize_int4

    assert torch.equal(pack_nibbles(torch.tensor([[1, 2, 15, 0]])), torch.tensor([[0x21, 0x0F]], dtype=torch.uint8))
    files = {k: f for f in ckpts["int4"].glob("*.safetensors") for k in safe_open(f, "pt").keys()}
    src = {k: f for f in ckpts["bf16"].glob("*.safetensors") for k in safe_open(f, "pt").keys()}
    key = f"{EXPERT}.down_proj"

    def get(d, k):
        with safe_open(d[k], "pt") as f:
            return f.get_tensor(k)

    w = get(src, key + ".weight")
    codes, sz = quantize_int4(w, 32)
    assert torch.equal(unpack_nibbles(get(files, key + ".qweight")), codes)
    assert torch.equal(get(files, key + ".weight_scale"), sz[..., 0].t())
    assert torch.equal(get(files, key + ".weight_zero"), sz[..., 1].t())
    deq = (codes.float() - 8).view(64, 2, 32) * get(files, key + ".weight_scale").float().unsqueeze(-1)
    deq = deq + get(files, key + ".weight_zero").float().unsqueeze(-1)
    assert torch.equal(deq.view(64, 64), dequantize_int4(codes, sz))
    cfg = json.loads((ckpts["int4"] / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["trunk"], cfg["experts"], cfg["group_size"]) == ("flashnext_int", "int8",
                                                                                      "int4", 32)  # fmt: skip
    assert "model.layers.1.mlp.experts" in cfg["modules"]["int4"] and "lm_head" in cfg["modules"]["int8"]
    assert (ckpts["int4"] / "tokenizer_config.json").exists() and (ckpts["int4"] / "model.safetensors.index.json")


class _FloatTensors(TorchDispatchMode):
    """Shapes of every floating-point CPU tensor an op returns (allocations, copies, casts) while active."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "cpu":
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_loading_never_creates_a_float_tensor_of_a_quantized_weight(ckpts, weights):
    """Peak memory: the quantized parts are never materialised in float (no stacked or per-expert expert weight,
    no quantized linear's weight shape unless a kept float tensor has it too). The same detector flags the old
    route (load the float checkpoint, then quantize)."""
    E, I, D = 8, 64, 64
    expert_shapes = {(E, 2 * I, D), (E, D, I), (2 * I, D)}
    with _FloatTensors() as old:
        quantize_model(flashnext.from_pretrained(ckpts["bf16"], dtype=torch.bfloat16), SCHEMES[weights])
    assert expert_shapes <= old.shapes
    with _FloatTensors() as new:
        model = flashnext.from_pretrained(ckpts[weights], dtype=torch.bfloat16)
    kept = {tuple(t.shape) for t in model.state_dict().values() if t.is_floating_point()}
    kept |= {tuple(t.shape) for m in model.modules() if isinstance(m, Int8Linear) for t in (m.scale, m.bias)
             if t is not None}  # fmt: skip
    linears = {tuple(m.qweight.shape) for m in model.modules() if isinstance(m, Int8Linear)}
    assert (expert_shapes | linears) - kept, "the check must look at something"
    assert new.shapes & ((expert_shapes | linears) - kept) == set()


def test_quantize_command_refuses_another_checkpoint_unless_overwrite(ckpts, tmp_path, capsys):
    src, out = ckpts["bf16"], tmp_path / "out"
    out.mkdir()
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    args = ["quantize", "--trunk", "int8", "--experts", "int4", "--group-size", "32", str(src), str(out)]
    assert cli_main(args) != 0
    assert "not empty" in capsys.readouterr().err and (out / "model-00009-of-00009.safetensors").exists()
    assert cli_main([*args, "--overwrite"]) == 0
    assert "trunk int8, experts int4 g32" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ckpts["int4"].iterdir())
    assert headers(out) == headers(ckpts["int4"])
    with pytest.raises(CheckpointError, match="already quantised"):
        quantize_int(ckpts["int8"], tmp_path / "twice", SCHEMES["int8"])
    assert cli_main(["quantize", "--weights", "fp8", "--experts", "int4", str(src), str(tmp_path / "x")]) != 0
    assert "--trunk/--experts go with --weights int8|int4" in capsys.readouterr().err


def _copy(ckpts, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(ckpts[name], dst)
    return dst


def _edit(directory, key, edit) -> None:
    file = next(f for f in directory.glob("*.safetensors") if key in headers_of(f))
    rewrite(file, edit)


def headers_of(file) -> set[str]:
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        return set(f.keys())


def _refused(directory, *needles) -> None:
    with pytest.raises(CheckpointError) as err:
        flashnext.from_pretrained(directory)
    text = str(err.value)
    for n in needles:
        assert n in text, text


def test_refuses_codes_without_scales_and_mis_shaped_codes(ckpts, tmp_path):
    d = _copy(ckpts, "int4", tmp_path)
    _edit(d, f"{EXPERT}.up_proj.weight_scale", lambda t: t.pop(f"{EXPERT}.up_proj.weight_scale"))
    _edit(d, f"{LINEAR}.qweight", lambda t: t.update({f"{LINEAR}.qweight": t[f"{LINEAR}.qweight"][:-1]}))
    _refused(d, f"missing: {EXPERT}.up_proj.weight_scale (the codes need their scales",
             f"mis-shaped: {LINEAR}.qweight is [7, 64] I8, expected [8, 64] I8")  # fmt: skip


def test_refuses_a_float_weight_left_beside_codes(ckpts, tmp_path):
    d = _copy(ckpts, "int8", tmp_path)
    _edit(d, f"{LINEAR}.qweight", lambda t: t.update({f"{LINEAR}.weight": torch.zeros(32, 64)}))
    _refused(d, f"unexpected: {LINEAR}.weight is a float weight of the quantized module {LINEAR}")


@pytest.mark.parametrize(
    "field, value, needle",
    [("trunk", "int3", "quantization_config.trunk='int3': expected one of ['bf16', 'int8']"),
     ("group_size", 48, "quantization_config.group_size=48: int4 groups of [32, 64, 128]"),
     ("experts", "int8", "undeclared: model.layers.0.mlp.experts is int8"),
     ("format_version", 2, "format_version=2")],
)  # fmt: skip
def test_refuses_an_unknown_scheme_or_group(ckpts, tmp_path, field, value, needle):
    d = _copy(ckpts, "int4", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"][field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(d, needle)


def test_an_int_checkpoint_off_the_cpu_is_refused_before_loading(ckpts):
    with pytest.raises(ConfigError, match="runs on the CPU .*asked for cuda"):
        flashnext.from_pretrained(ckpts["int8"], device="cuda")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantize_reads_one_tensor_at_a_time(ckpts, tmp_path, weights):
    """The writer's peak: no stacked expert weight, no float tensor larger than the largest tensor of the source."""
    largest = max(torch.Size(s).numel() for s, _ in headers(ckpts["bf16"]).values())
    with _FloatTensors() as seen:
        quantize_int(ckpts["bf16"], tmp_path / "out", SCHEMES[weights])
    assert seen.shapes and not {(8, 128, 64), (8, 64, 64)} & seen.shapes
    assert max(torch.Size(s).numel() for s in seen.shapes) <= largest


def test_serving_flags_must_match_the_stored_scheme(ckpts):
    """`serve --weights int4` on an int8 checkpoint: one line naming both; the stored scheme (or no flag) serves
    it as stored."""
    from flashnext.serve.loading import load_for_serving

    with pytest.raises(ConfigError, match=r"ask for trunk int8, experts int4 g64 but the checkpoint is quantized as "
                                          r"trunk int8, experts int8"):  # fmt: skip
        load_for_serving(ckpts["int8"], quant=QuantScheme.from_flags("int4"))
    model, _, _ = load_for_serving(ckpts["int8"], quant=QuantScheme.from_flags("int8"))
    assert isinstance(model.lm_head, Int8Linear)
    model, _, _ = load_for_serving(ckpts["int4"], quant=QuantScheme.from_flags("bf16"))
    assert model.model.layers[0].mlp.experts.scheme == "int4"


def test_weight_sync_into_a_server_loaded_from_an_int8_checkpoint_requantizes(ckpts):
    """A trainer's float weights synced into an engine loaded from the int8 checkpoint land requantized: equal to
    quantizing the trainer's model directly (bitwise: same functions, same kernels)."""
    from flashnext.rl.weights import sync_local
    from flashnext.serve.engine import Engine
    from flashnext.serve.prepare import prepare_for_inference

    engine = Engine(prepare_for_inference(flashnext.from_pretrained(ckpts["int8"], dtype=torch.bfloat16)),
                    max_slots=2, max_model_len=32)  # fmt: skip
    trainer = flashnext.from_pretrained(ckpts["bf16"], dtype=torch.bfloat16)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    assert sync_local(trainer, engine, full=True).tensors > 0
    direct = prepare_for_inference(quantize_model(trainer, SCHEMES["int8"]))
    with torch.no_grad():
        assert torch.equal(engine.model(_ids()).logits, direct(_ids()).logits)


def test_composite_checkpoint_loads_bitwise_as_quantize_model(tmp_path, small_config_module):
    """A composite (vision) checkpoint: the trunk quantized, the vision tower kept float, bitwise as in memory."""
    from flashnext.model.multimodal import FlashNextForConditionalGeneration

    text = {**small_config_module, **OVERRIDES, "mtp_num_hidden_layers": 0}
    vision = dict(TINY_VISION, out_hidden_size=64)
    cfg = parse_config(dict(model_type="qwen4_exp", text_config=text, vision_config=vision))
    save_pretrained(_perturbed(FlashNextForConditionalGeneration(cfg)).to(torch.bfloat16), tmp_path / "bf16")
    quantize_int(tmp_path / "bf16", tmp_path / "int4", SCHEMES["int4"])
    loaded = flashnext.from_pretrained(tmp_path / "int4", dtype=torch.float32)
    direct = quantize_model(flashnext.from_pretrained(tmp_path / "bf16", dtype=torch.float32), SCHEMES["int4"])
    assert any(isinstance(m, torch.nn.Linear) for m in loaded.visual.modules())
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, direct(_ids()).logits)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_plan_of_an_int_checkpoint_reports_its_quantized_bytes(ckpts, weights):
    """`flashnext plan` (and serve's plan with the default flags) reads the scheme and group from config.json: the
    routed experts' row is the bytes the loaded model's `QuantExperts` hold (int4 with the stored group 32)."""
    from flashnext.cli.plan import build_plan
    from flashnext.plan import PlanOptions

    opts = PlanOptions(dtype="bf16", max_slots=0)
    rows = {r.part: r for r in build_plan(str(ckpts[weights]), opts)[0].rows}
    loaded = flashnext.from_pretrained(ckpts[weights], dtype=torch.bfloat16)
    held = sum(b.nbytes for m in loaded.model.modules() if isinstance(m, QuantExperts) for b in m.buffers())
    assert rows["routed experts"].bytes == held and rows["routed experts"].note.startswith(weights)
    assert rows["lm_head"].note == "int8"
    assert rows["lm_head"].bytes == sum(t.nbytes for t in (loaded.lm_head.qweight, loaded.lm_head.scale))


def test_a_tied_checkpoint_stores_lm_head_codes_from_the_embedding(tmp_path, small_config_module):
    """A tied checkpoint has no `lm_head.weight` (from_pretrained copies the embedding into it, which
    quantize_model then quantizes): its codes are made from the embedding's bytes, bitwise as in memory."""
    cfg = parse_config({**small_config_module, **OVERRIDES, "tie_word_embeddings": True, "mtp_num_hidden_layers": 0})
    model = _perturbed(FlashNextForCausalLM(cfg.text))
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    save_pretrained(model.to(torch.bfloat16), tmp_path / "bf16")
    assert "lm_head.weight" not in headers(tmp_path / "bf16")
    quantize_int(tmp_path / "bf16", tmp_path / "int8", SCHEMES["int8"])
    assert {"lm_head.qweight", "model.embed_tokens.weight"} <= set(headers(tmp_path / "int8"))
    loaded = flashnext.from_pretrained(tmp_path / "int8", dtype=torch.float32)
    direct = quantize_model(flashnext.from_pretrained(tmp_path / "bf16", dtype=torch.float32), SCHEMES["int8"])
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, direct(_ids()).logits)
