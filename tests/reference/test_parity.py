"""Our model == transformers' Qwen4ExpForCausalLM (fp32): logits, loss and every parameter's gradient.

Each case builds a tiny reference with every weight randomised, saves it in the official layout, loads it with
`flashnext.from_pretrained`, and compares on a right-padded batch and on the same sequences packed flat.
Sequence lengths cover: 1, shorter than a QSA block, exactly the budget, several budgets, and an EOS inside.
"""

import pytest
import torch

import flashnext
from flashnext import save_pretrained

CASES = {
    "default": {},
    "hc4-ngram2-sigmoid-eoslist-rope1": dict(
        hc_count=4,
        ngram_size=2,
        heads_per_ngram=4,
        partial_rotary_factor=1.0,
        output_gate_type="sigmoid",
        eos_token_id=[3, 5],
        norm_topk_prob=False,
    ),
    "ngram4-rope025-noPLEconvgap": dict(
        ngram_size=4, heads_per_ngram=2, ple_embed_dim=24, partial_rotary_factor=0.25, ple_conv_kernel_size=3
    ),
    "no-ple": dict(ple_layer_ids=[]),
}
LENGTHS = [40, 1, 3, 8, 29]  # several budgets (budget 8, block 4), len 1, < block, == budget, mid


def _batch(vocab, eos, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = max(LENGTHS)
    ids = torch.randint(0, vocab, (len(LENGTHS), S), generator=g)
    ids[ids == eos] = eos + 1
    ids[0, 12] = eos  # EOS inside a sequence: n-gram context restarts after it
    ids[4, 20] = eos
    mask = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = 1
    labels = torch.where(mask.bool(), ids, -100)
    return ids * mask, mask, labels


@pytest.fixture(params=list(CASES), ids=list(CASES))
def pair(request, tiny_text_config, reference_factory):
    cfg = tiny_text_config(**CASES[request.param])
    ref, path = reference_factory(cfg, seed=1)
    ours = flashnext.from_pretrained(path, dtype=torch.float32)
    return ref, ours, cfg


def _eos(cfg):
    eos = cfg["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


def test_padded_logits_loss_and_grads(pair, rel_error):
    ref, ours, cfg = pair
    ids, mask, labels = _batch(cfg["vocab_size"], _eos(cfg))
    ref_out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    our_out = ours(ids, attention_mask=mask, labels=labels)
    keep = mask.bool()
    assert rel_error(our_out.logits[keep], ref_out.logits[keep]) <= 1e-4
    assert rel_error(our_out.loss, ref_out.loss) <= 1e-5
    ref_out.loss.backward()
    our_out.loss.backward()
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        rp = ref_params[name]
        if rp.grad is None:  # the QSA indexer: selection is discrete, no gradient in either model
            assert "indexer" in name and (p.grad is None or p.grad.abs().max() == 0), name
            continue
        assert p.grad is not None, name
        # fp32 backward through 4 layers sums in a different order than the reference: ~1e-4 noise.
        assert rel_error(p.grad, rp.grad) <= 1e-3, name
        checked += 1
    assert checked == len(ref_params) - sum("indexer" in n for n in ref_params)


def test_packed_equals_reference_and_each_alone(pair, rel_error):
    ref, ours, cfg = pair
    ids, mask, labels = _batch(cfg["vocab_size"], _eos(cfg), seed=3)
    with torch.no_grad():
        ref_logits = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        flat = ids[mask.bool()]
        cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
        packed = ours(flat, cu_seqlens=cu).logits
        assert packed.shape == (sum(LENGTHS), cfg["vocab_size"])
        assert rel_error(packed, ref_logits) <= 1e-4
        for n in range(len(LENGTHS)):
            a, b = int(cu[n]), int(cu[n + 1])
            alone = ours(flat[a:b], cu_seqlens=torch.tensor([0, b - a], dtype=torch.int32)).logits
            torch.testing.assert_close(packed[a:b], alone, rtol=1e-5, atol=1e-5)


def test_roundtrip_through_transformers(pair, tmp_path, rel_error):
    """ours -> save_pretrained -> transformers loads it -> the same logits."""
    from transformers import Qwen4ExpForCausalLM

    _, ours, cfg = pair
    save_pretrained(ours, tmp_path / "ours")
    back = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    ids, mask, _ = _batch(cfg["vocab_size"], _eos(cfg), seed=5)
    with torch.no_grad():
        a = back(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        b = ours(ids, attention_mask=mask).logits[mask.bool()]
    assert rel_error(b, a) <= 1e-4
