"""Analytic FLOPs (`count_flops`) against torch's `FlopCounterMode` on the meta device, with CUDA hidden.

Dense components (projections, MoE routed via the meta gather path, shared expert, router, PLE, hyper, lm_head)
and the GDN chunk matmuls must match exactly: the analytic formulas are the same matmuls. Three differences are
by design and checked as exact formulas, not a loose tolerance:
- the convs are counted analytically but not by `FlopCounterMode` (`NOT_MATMUL`);
- QSA attention issues QK^T / PV over all `(budget/c + 1) * c` gathered slots per query (masked ones included),
  while the analytic count is over the selected tokens only;
- the indexer scores every block of its query chunk's range (one chunk here), the analytic count only the blocks
  each query can see.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from flashnext.config import TextConfig
from flashnext.flops import COMPONENTS, NOT_MATMUL, count_flops, flop_terms

SEQ_LENS = [9, 21, 1, 6]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from flashnext.config import TextConfig
    from flashnext.flops import measure_flops_on_meta

    cfg = TextConfig.from_dict(json.loads(sys.argv[1]))
    out = measure_flops_on_meta(cfg, json.loads(sys.argv[2]))
    assert not torch.cuda.is_initialized(), "CUDA was initialised"
    print("FLOPS=" + json.dumps(out))
    """
)


def _measure_in_clean_process(config: dict, seq_lens: list[int]) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(config), json.dumps(seq_lens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FLOPS=")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(lines[0].removeprefix("FLOPS="))


def _issued_qsa(cfg: TextConfig, seq_lens: list[int]) -> tuple[float, float]:
    """(indexer scores, attention QK^T + PV) as issued by ops.qsa for a batch scored in one query chunk."""
    T, c = sum(seq_lens), cfg.indexer_compress_ratio
    n_attn = sum(t != "linear_attention" for t in cfg.layer_types)
    blocks = sum(n // c for n in seq_lens)
    scores = 2 * T * cfg.indexer_n_heads * cfg.indexer_head_dim * blocks
    slots = (cfg.indexer_budget // c + 1) * c
    attend = 4 * T * cfg.num_attention_heads * cfg.head_dim * slots
    return n_attn * scores, n_attn * attend


def test_analytic_matches_meta_flop_counter(small_config):
    cfg = TextConfig.from_dict(small_config)
    measured = _measure_in_clean_process(small_config, SEQ_LENS)
    terms = flop_terms(cfg, SEQ_LENS)
    analytic = count_flops(cfg, SEQ_LENS)
    print({c: (analytic[c], measured[c]) for c in (*COMPONENTS, "total")})

    assert measured["other"] == 0  # every counted FLOP belongs to a component
    assert measured["total"] == sum(measured[c] for c in COMPONENTS)
    matmul = {c: sum(v for k, v in terms[c].items() if k not in NOT_MATMUL) for c in COMPONENTS}
    for comp in ("gdn", "moe_routed", "moe_shared", "router", "ple", "hyper", "lm_head"):
        assert measured[comp] == matmul[comp], comp

    scores, attend = _issued_qsa(cfg, SEQ_LENS)
    assert measured["qsa_indexer"] == terms["qsa_indexer"]["proj"] + scores
    assert measured["qsa_attention"] == terms["qsa_attention"]["proj"] + attend
    for comp in ("qsa_indexer", "qsa_attention"):  # issued work bounds the useful work from above
        assert analytic[comp] < measured[comp], comp
    assert analytic["total"] == pytest.approx(sum(analytic[c] for c in COMPONENTS))


def test_sparse_components_scale_linearly_past_the_budget(small_config):
    cfg = TextConfig.from_dict(small_config)
    budget = cfg.indexer_budget  # 8 tokens: past it every query attends budget + tail tokens
    a, b = count_flops(cfg, [1000]), count_flops(cfg, [2000])
    attend = [flop_terms(cfg, [n])["qsa_attention"]["attend"] for n in (1000, 2000)]
    assert attend[1] / attend[0] == pytest.approx(2.0, rel=2 * budget / 1000)
    for comp in ("moe_routed", "moe_shared", "router", "ple", "hyper", "lm_head"):
        assert b[comp] == 2 * a[comp], comp
    # Packing does not change dense work; the GDN chunk term pays each sequence's padded last chunk.
    packed = count_flops(cfg, [10, 10])
    single = count_flops(cfg, [20])
    assert packed["lm_head"] == single["lm_head"] and packed["gdn"] > single["gdn"]
