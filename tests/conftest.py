"""Shared fixtures: a small but complete text config (GDN + PLE + QSA + MoE) for tests of our own code."""

import pytest
import torch

SMALL_TEXT_CONFIG = dict(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=4,
    linear_value_head_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    shared_expert_intermediate_size=8,
    hc_count=2,
    hc_lowrank=4,
    ple_layer_ids=[2],
    ple_embed_dim=8,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=40,
    make_ngram_vocab_size_divisible_by=8,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    indexer_budget=8,
    indexer_compress_ratio=4,
    eos_token_id=3,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
)


@pytest.fixture
def small_config():
    """A fresh copy of `SMALL_TEXT_CONFIG` (official config.json field names) to modify freely."""
    return {
        k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
        for k, v in SMALL_TEXT_CONFIG.items()
    }


@pytest.fixture(scope="module")
def small_config_module():
    """A copy of `SMALL_TEXT_CONFIG` for module-scoped fixtures (e.g. a model built once per test file)."""
    return {
        k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
        for k, v in SMALL_TEXT_CONFIG.items()
    }


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (tiny serving steps: no thread hand-off cost, no oversubscription on a
    shared box); restored after. Directories and files opt in (`tests/serve/conftest.py`, `pytestmark`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _denormals_kept():
    """Every test starts with IEEE denormals (torch's default) on its threads: the trainer and `serve` flush them
    (`flashnext.denormals`), and a test running either in this process would otherwise change later tests'
    floating-point mode."""
    yield
    from flashnext.denormals import flush_denormals

    flush_denormals(False)
