"""bf16: our model tracks the reference run in bf16, keeping fp32 where the reference does."""

import torch
from transformers import Qwen4ExpForCausalLM

import flashnext


def test_bf16_matches_reference_bf16(reference_checkpoint, rel_error):
    ref32, path = reference_checkpoint
    ref16 = Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ours16 = flashnext.from_pretrained(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours16.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 128, (2, 33), generator=g)
    with torch.no_grad():
        exact = ref32(input_ids=ids).logits
        theirs = ref16(input_ids=ids).logits.float()
        ours = ours16(ids).logits
    assert ours.dtype == torch.bfloat16
    ours = ours.float()
    # Our bf16 is as close to the fp32 function as the reference's bf16 is (same roundings, same fp32 islands).
    err_ours, err_ref = rel_error(ours, exact), rel_error(theirs, exact)
    print(f"bf16 rel. error vs fp32: ours={err_ours:.4f} reference={err_ref:.4f}")
    assert err_ours <= 1.5 * err_ref, (err_ours, err_ref)
