"""Input handling on our own model: padded (left/right) == packed, zero-length sequences, named input errors."""

import pytest
import torch

from flashnext.config import TextConfig
from flashnext.errors import InputError
from flashnext.model.text import FlashNextForCausalLM


@pytest.fixture
def model(small_config):
    torch.manual_seed(0)
    m = FlashNextForCausalLM(TextConfig.from_dict(small_config))
    m.init_weights(seed=0)
    with torch.no_grad():  # non-trivial norms and PLE conv
        for name, p in m.named_parameters():
            if "norm" in name or "conv" in name:
                p.normal_(0, 0.2)
    return m.eval()


def test_left_and_right_padding_equal_packed(model):
    lens = [5, 1, 20]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, 64, (n,), generator=g) for n in lens]
    flat = torch.cat(seqs)
    cu = torch.tensor([0, 0] + lens).cumsum(0).to(torch.int32)  # a zero-length sequence first
    with torch.no_grad():
        packed = model(flat, cu_seqlens=cu).logits
        S = max(lens)
        for side in ("left", "right"):
            ids = torch.zeros(len(lens), S, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, s in enumerate(seqs):
                sl = slice(S - len(s), S) if side == "left" else slice(0, len(s))
                ids[b, sl], mask[b, sl] = s, 1
            out = model(ids, attention_mask=mask).logits
            assert out.shape == (3, S, 64)
            torch.testing.assert_close(out[mask.bool()], packed, rtol=1e-5, atol=1e-5)
            assert (out[~mask.bool()] == 0).all()


def test_loss_is_independent_of_packing(model):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(4, 64, (9,), generator=g), torch.randint(4, 64, (13,), generator=g)
    flat = torch.cat([a, b])
    cu = torch.tensor([0, 9, 22], dtype=torch.int32)
    with torch.no_grad():
        both = model(flat, cu_seqlens=cu, labels=flat).loss
        la = model(a, labels=a).loss
        lb = model(b, labels=b).loss
    # mean over 8 + 12 predicted tokens; no prediction crosses the sequence boundary
    torch.testing.assert_close(both, (la * 8 + lb * 12) / 20)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=torch.tensor([1, 2, 64])), r"input_ids\[2\]=64"),
        (dict(input_ids=torch.tensor([1, -1])), r"input_ids\[1\]=-1"),
        (dict(input_ids=torch.tensor([1, 2, 3]), cu_seqlens=torch.tensor([0, 2])), "end at T=3"),
        (dict(input_ids=torch.tensor([1, 2, 3]), cu_seqlens=torch.tensor([0, 3, 2, 3])), "non-decreasing"),
        (dict(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 0, 1]])), "row 0 has holes"),
        (dict(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[1, 1, 1]])), "attention_mask shape"),
        (dict(input_ids=torch.tensor([1, 2]), position_ids=torch.tensor([0, 1, 2])), "position_ids"),
    ],
)
def test_bad_inputs_raise_named_errors(model, kwargs, match):
    with pytest.raises(InputError, match=match):
        model(**kwargs)
