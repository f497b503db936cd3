"""Input handling on our own model: padded (left/right) == packed, zero-length sequences, empty batches, any integer
id dtype, and a battery of bad inputs that each raise an InputError naming the argument, shape or dtype."""

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


T3 = torch.tensor([1, 2, 3])
P13 = torch.tensor([[1, 2, 3]])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=torch.tensor([1, 2, 64])), r"input_ids\[2\]=64"),
        (dict(input_ids=torch.tensor([1, -1])), r"input_ids\[1\]=-1"),
        (dict(input_ids=T3, cu_seqlens=torch.tensor([0, 2])), "end at T=3"),
        (dict(input_ids=T3, cu_seqlens=torch.tensor([0, 3, 2, 3])), "non-decreasing"),
        (dict(input_ids=P13, attention_mask=torch.tensor([[1, 0, 1]])), "row 0 has holes"),
        (dict(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[1, 1, 1]])), "attention_mask shape"),
        (dict(input_ids=torch.tensor([1, 2]), position_ids=torch.tensor([0, 1, 2])), "position_ids"),
        # ids: integer tensors of rank 1 or 2
        (dict(input_ids=torch.tensor([1.0, 2.0])), r"input_ids must be an integer tensor, got dtype torch.float32"),
        (dict(input_ids=torch.tensor([True, False])), r"input_ids must be an integer tensor, got dtype torch.bool"),
        (dict(input_ids=[1, 2, 3]), "input_ids must be a torch.Tensor, got list"),
        (dict(input_ids=torch.ones(1, 2, 3, dtype=torch.long)), r"input_ids must be \[B, S\] or flat \[T\]"),
        # cu_seqlens
        (dict(input_ids=T3, cu_seqlens=torch.tensor([0.0, 3.0])), "cu_seqlens must be an integer tensor, got dtype"),
        (dict(input_ids=P13, cu_seqlens=torch.tensor([0, 3])), "cu_seqlens is for flat"),
        # positions: [T] / [3, T] for flat ids, [B, S] / [3, B, S] for padded ones, integers
        (
            dict(input_ids=T3, position_ids=torch.zeros(2, 3, dtype=torch.long)),
            r"\[T\] or \[3, T\].*got shape \(2, 3\)",
        ),
        (dict(input_ids=T3, position_ids=torch.tensor([0.0, 1.5, 2.0])), "position_ids must be an integer tensor"),
        (
            dict(input_ids=P13, position_ids=torch.tensor([[0, 1]])),
            r"\[B, S\] or \[3, B, S\].*like input_ids \(1, 3\), got shape \(1, 2\)",
        ),
        (dict(input_ids=P13, position_ids=torch.zeros(2, 1, 3, dtype=torch.long)), r"got shape \(2, 1, 3\)"),
        (dict(input_ids=P13, position_ids=torch.zeros(3, dtype=torch.long)), r"got shape \(3,\)"),
        # a mask with flat ids would be ignored
        (dict(input_ids=T3, attention_mask=torch.tensor([1, 1, 0])), "attention_mask is for padded"),
        # labels: input_ids' shape, integers
        (dict(input_ids=T3, labels=torch.tensor([1, 2])), r"labels shape \(2,\) != input_ids shape \(3,\)"),
        (dict(input_ids=P13, labels=torch.tensor([1, 2, 3])), r"labels shape \(3,\) != input_ids shape \(1, 3\)"),
        (dict(input_ids=T3, labels=torch.tensor([1.0, 2.0, 3.0])), "labels must be an integer tensor"),
        # router replay: int [T, L, k]
        (
            dict(input_ids=T3, routed_experts=torch.zeros(3, 4, 1, dtype=torch.long)),
            r"routed_experts must be \[T, L, k\] = \[3, 4, 2\].*got shape \(3, 4, 1\)",
        ),
        (dict(input_ids=T3, routed_experts=torch.zeros(3, 4, 2)), "routed_experts must be an integer tensor"),
    ],
)
def test_bad_inputs_raise_named_errors(model, kwargs, match):
    with pytest.raises(InputError, match=match):
        model(**kwargs)


def test_any_integer_id_dtype(small_config):
    """Ids of any integer dtype give the int64 result; uint8 ids used to compare with the vocab bound in uint8."""
    torch.manual_seed(0)
    big = FlashNextForCausalLM(TextConfig.from_dict({**small_config, "vocab_size": 300}))
    big.init_weights(seed=0)
    ids = torch.tensor([0, 5, 200, 255])
    with torch.no_grad():
        want = big(ids).logits
        for dtype in (torch.uint8, torch.int16, torch.int32):
            torch.testing.assert_close(big(ids.to(dtype)).logits, want)
        with pytest.raises(InputError, match=r"input_ids\[1\]=300 is outside the vocabulary \[0, 300\)"):
            big(torch.tensor([299, 300], dtype=torch.int16))  # the bound is still checked


def test_empty_batches_give_empty_logits(model):
    """`[0, S]`, `[B, 0]`, `[0]` and an all-padding batch are valid: empty outputs, no sequence is blamed."""
    with torch.no_grad():
        for ids, mask, shape in [
            (torch.zeros(0, 5, dtype=torch.long), None, (0, 5, 64)),
            (torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5), (0, 5, 64)),
            (torch.zeros(2, 0, dtype=torch.long), None, (2, 0, 64)),
            (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), (2, 3, 64)),
            (torch.zeros(0, dtype=torch.long), None, (0, 64)),
        ]:
            out = model(ids, attention_mask=mask)
            assert out.logits.shape == shape and (out.logits == 0).all()
            assert out.routed_experts.shape == (0, 4, 2)


def test_mrope_positions_are_valid_for_flat_text_input(model):
    """`[3, T]` positions with equal axes are text positions: the same logits as `[T]`."""
    ids = torch.randint(4, 64, (7,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(7) + 2
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, position_ids=pos.expand(3, 7)).logits, model(ids, position_ids=pos).logits
        )
        padded = model(ids[None], position_ids=pos.expand(3, 1, 7)).logits[0]
    torch.testing.assert_close(padded, model(ids, position_ids=pos).logits)
