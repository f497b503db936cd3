"""The serving feature matrix: every combination of the engine's options either serves what the plain model says, or
is refused at start-up with a one-line error saying why.

Axes (`AXES`): compute dtype {fp32, bf16} x decode step {eager, graph} x MTP speculative decoding {off, on} x n-gram
tables {memory, fp8, mmap} x prefix cache {off, on} (64-token blocks; two prompts share a 70-token prefix and the
second resumes from the first's block) x weights {float, int8} (`flashnext.quant`, in memory): 96 cells. One
checkpoint (bf16 weights, so fp32 and bf16 serve the same values) and its FP8-table twin; every cell serves the same
three prompts greedily (8 tokens, with log-probs) and is checked against the plain fp32 forward of the same weights
over each cell's own output (teacher-forced), token by token:
- the cell's log-prob of each token it chose equals the plain forward's within the cell's tolerance, and
- that token is the plain forward's argmax, up to a near tie within the same tolerance (a tie broken the other way
  in a reordered sum is not an error; a wrong path is off by far more).
Tolerances: fp32 cells 2e-4 (the decode graph's padded shapes, the verify step's 1 + k rows and the fused
projections reorder fp32 sums: rounding only; measured at most 5e-7); bf16 cells 0.05 (bf16 weights and
activations, ~3 significant digits through 2 layers and a 64-way log-softmax; measured at most 9.3e-3); int8 cells
0.3 (weight-only int8 per output channel of 16-wide rows, against the float weights: measured at most 0.16 over
every position of these prompts, 0.072 on the generated ones; a wrong path is off by whole nats). MTP cells
take their drafts from the plain greedy continuation with some replaced (`spec_helpers.KnownDrafts`), so
acceptance, partial acceptance and rejection all occur, and must report at least one accepted draft.

The diagonal (`DIAGONAL`: each value of each axis at least once) runs by default; the full product is marked slow
(`pytest -m slow tests/serve/test_feature_matrix.py`, run by `.ci/run`; the README's feature table is its result).
"""

from __future__ import annotations

import itertools
import re
from functools import cache
from pathlib import Path

import pytest
import torch
from serve_helpers import small_model
from spec_helpers import KnownDrafts

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint.quantize import quantize_checkpoint
from flashnext.errors import ConfigError
from flashnext.quant.apply import QuantScheme, quantize_model
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams

AXES = {
    "dtype": ("fp32", "bf16"),
    "decode": ("eager", "graph"),
    "mtp": ("off", "on"),
    "tables": ("memory", "fp8", "mmap"),
    "prefix": ("off", "on"),
    "weights": ("float", "int8"),
}
DIAGONAL = [
    ("fp32", "eager", "off", "memory", "off", "float"),
    ("fp32", "graph", "on", "fp8", "on", "int8"),
    ("bf16", "eager", "on", "mmap", "on", "float"),
    ("bf16", "graph", "off", "fp8", "off", "int8"),
    ("bf16", "eager", "off", "memory", "on", "int8"),
    ("fp32", "graph", "off", "mmap", "on", "float"),  # refused
]
FULL = [c for c in itertools.product(*AXES.values()) if c not in DIAGONAL]
TOL = {"fp32": 2e-4, "bf16": 0.05, "int8": 0.3}
SHARED = [(7 * i + 3) % 61 + 1 for i in range(70)]  # a 70-token prefix: one 64-token prefix-cache block
PROMPTS = [SHARED + [5, 9, 2, 7, 11], SHARED + [3, 40, 41, 8, 1, 60, 2, 2, 17], [12, 13, 14, 15, 16, 17, 18, 19]]
MAX_TOKENS = 8
# Refused combinations: (predicate over the cell, the start-up error it must raise).
REFUSED = [
    (lambda dtype, decode, mtp, tables, prefix, weights: decode == "graph" and tables == "mmap",
     ConfigError("the compiled decode step needs in-memory n-gram tables: --ngram-storage mmap")),
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, small_config_module) -> Path:
    """A two-layer model (GDN with PLE, QSA) with an MTP head, saved with bf16 weights, and its FP8-table twin."""
    cfg = {**small_config_module, "num_hidden_layers": 2, "layer_types": ["linear_attention", "indexed_attention"]}
    cfg.update(ple_layer_ids=[1], mtp_num_hidden_layers=1)
    root = tmp_path_factory.mktemp("matrix")
    save_pretrained(small_model(cfg, seed=3).to(torch.bfloat16), root / "bf16")
    quantize_checkpoint(root / "bf16", root / "fp8")
    return root


@cache
def _plain(path: str):
    """The plain fp32 model of a checkpoint (tables dense: FP8 rows upcast), for the teacher-forced check."""
    return flashnext.from_pretrained(path, dtype=torch.float32, ngram_storage="dense").eval()


def _plain_greedy(path: str) -> dict[tuple, list[int]]:
    """Greedy continuations of the plain model (the MTP cells' known drafts)."""
    model, out = _plain(path), {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = list(p)
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor(ids)).logits[-1].argmax()))
            out[tuple(p)] = ids[len(p) :]
    return out


def serve_cell(root: Path, dtype: str, decode: str, mtp: str, tables: str, prefix: str, weights: str):
    """Serve `PROMPTS` in one cell: (completions, engine). The first prompt goes first, alone, so that with the
    prefix cache on the second resumes from its cached 64-token block."""
    path = root / ("fp8" if tables == "fp8" else "bf16")
    storage = {"memory": "auto", "fp8": "auto", "mmap": "mmap"}[tables]
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = flashnext.from_pretrained(path, dtype=torch_dtype, ngram_storage=storage)
    if weights == "int8":  # weight-only int8 trunk and experts, quantized in memory (`flashnext.quant`)
        quantize_model(model, QuantScheme.from_flags("int8"))
    graph = dict(decode_graph=True, decode_buckets=[4], compile_backend="eager") if decode == "graph" else {}
    engine = Engine(model, max_slots=4, max_model_len=128, max_num_batched_tokens=16,
                    num_speculative_tokens=2 if mtp == "on" else 0, prefix_cache=prefix == "on", prefix_block_size=64,
                    **graph)  # fmt: skip
    if mtp == "on":
        KnownDrafts(engine, _plain_greedy(str(path)), p_wrong=0.3, seed=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    first = engine.generate([PROMPTS[0]], params)
    return first + engine.generate([list(p) for p in PROMPTS[1:]], params), engine


def check_cell(root: Path, cell: tuple[str, ...]) -> None:
    dtype, decode, mtp, tables, prefix, weights = cell
    for predicate, error in REFUSED:
        if predicate(*cell):
            with pytest.raises(type(error), match=re.escape(str(error))):
                serve_cell(root, *cell)
            return
    done, engine = serve_cell(root, *cell)
    plain, tol = _plain(str(root / ("fp8" if tables == "fp8" else "bf16"))), TOL["int8" if weights == "int8" else dtype]
    for prompt, c in zip(PROMPTS, done, strict=True):
        assert len(c.token_ids) == MAX_TOKENS
        with torch.no_grad():
            logp = torch.log_softmax(plain(torch.tensor(prompt + c.token_ids)).logits.float(), -1)
        rows = logp[len(prompt) - 1 : -1]
        chosen = rows.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), chosen, rtol=0, atol=tol)
        gap = rows.max(-1).values - chosen  # 0 where the cell chose the plain argmax
        assert float(gap.max()) <= tol, (cell, prompt, gap.tolist())
    if mtp == "on":
        assert engine.stats.spec_accepted > 0 and engine.stats.spec_drafted > engine.stats.spec_accepted
    if prefix == "on":
        assert done[1].cached_tokens == 64  # the shared block, with its GDN/PLE snapshot
    if decode == "graph" and mtp == "off":  # (steps holding a speculating request run eager by design)
        assert engine.decode_graph.compiles >= 1  # decode-only steps did run as the graph


@pytest.mark.parametrize("cell", DIAGONAL, ids="-".join)
def test_feature_matrix_diagonal(checkpoints, cell):
    check_cell(checkpoints, cell)


@pytest.mark.slow
@pytest.mark.parametrize("cell", FULL, ids="-".join)
def test_feature_matrix_full(checkpoints, cell):
    check_cell(checkpoints, cell)
