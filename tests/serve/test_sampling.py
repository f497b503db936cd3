"""The sampler: non-finite parameters refused naming field and value, degenerate finite ones keep their limiting
meaning, rows isolated from each other, per-choice seeds."""

from __future__ import annotations

import math

import pytest
import torch

from flashnext.errors import InputError
from flashnext.serve.sampling import (
    FAILED,
    INT64_MAX,
    INT64_MIN,
    SamplingParams,
    attach_maxima,
    choice_seed,
    drop_maxima,
    sample,
)

V = 50


def _logits(n: int = 1, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("temperature", math.nan, "nan"),
        ("temperature", math.inf, "inf"),
        ("temperature", -math.inf, "-inf"),
        ("temperature", -0.5, "-0.5"),
        ("top_p", math.nan, "nan"),
        ("top_p", math.inf, "inf"),
        ("top_p", 0.0, "0.0"),
        ("top_p", 1.5, "1.5"),
        ("top_k", -1, "-1"),
        ("max_tokens", 0, "0"),
        ("seed", INT64_MAX + 1, str(INT64_MAX + 1)),
        ("seed", INT64_MIN - 1, str(INT64_MIN - 1)),
        ("logprobs", 21, "21"),
        ("n", 0, "0"),
        ("stop", [""], "''"),
        ("stop", ["a\ud800b"], "surrogate"),
    ],
)
def test_bad_values_refused_naming_field_and_value(field, value, shown):
    with pytest.raises(InputError, match=field) as err:
        SamplingParams(**{field: value}).validate()
    assert shown in str(err.value) and err.value.field.startswith(field)


def test_extreme_int64_seeds_accepted():
    for seed in (INT64_MIN, -1, 0, INT64_MAX):
        SamplingParams(seed=seed).validate()
        torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "temperature", [1e-45, 1e-300, 1e-38, 1e-37], ids=["denormal", "zero-in-fp32", "tiny", "1e-37"]
)
def test_tiny_temperature_is_greedy(temperature):
    """Tokens of any positive temperature too small to matter are the argmax: below fp32's smallest normal
    number the row is greedy; above it, logits scaled by 100 divided by 1e-37 would overflow without the shift
    by the maximum (inf - inf = NaN)."""
    logits = _logits(8, scale=100.0)
    params = [SamplingParams(temperature=temperature)] * 8
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    tokens, _ = sample(logits, params, gens)
    assert torch.equal(tokens, logits.argmax(-1))


def test_tiny_top_p_keeps_the_top_token():
    """top_p = 1e-300 rounds to 0 in fp32; the most likely token is still kept (so the sample is the argmax)."""
    logits = _logits(8)
    params = [SamplingParams(temperature=1.0, top_p=1e-300)] * 8
    tokens, _ = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(8)])
    assert torch.equal(tokens, logits.argmax(-1))


def test_huge_temperature_is_uniform_over_top_k():
    """temperature 1e300 (inf in fp32) is the T -> inf limit: uniform over the tokens top-k keeps."""
    logits = _logits(1)
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    seen = [int(sample(logits, [SamplingParams(temperature=1e300, top_k=3)], [gen])[0]) for _ in range(60)]
    assert set(seen) == top3


def test_rows_are_isolated():
    """Rows with NaN / +inf / all -inf logits give FAILED; every other row samples exactly as alone."""
    good = _logits(3, seed=1)
    logits = torch.cat([good[:1], torch.full((1, V), math.nan), good[1:2], good[2:3]])
    logits[1, 0] = 0.0
    bad_inf = good[0].clone()
    bad_inf[7] = math.inf
    logits = torch.cat([logits, bad_inf[None], torch.full((1, V), -math.inf)])
    params = [
        SamplingParams(temperature=0.8, top_p=0.9),  # good
        SamplingParams(temperature=0.8, top_k=4, top_p=0.5),  # NaN row
        SamplingParams(temperature=0.0),  # good, greedy
        SamplingParams(temperature=1.3, top_k=5),  # good
        SamplingParams(temperature=0.7),  # +inf row
        SamplingParams(temperature=0.0),  # all -inf
    ]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(6)]
    tokens, _ = sample(logits, params, [g.clone_state() for g in gens])
    assert tokens[[1, 4, 5]].tolist() == [FAILED] * 3
    for i, row in ((0, 0), (2, 1), (3, 2)):
        alone, _ = sample(good[row : row + 1], [params[i]], [gens[i].clone_state()])
        assert int(tokens[i]) == int(alone[0])


def test_greedy_rows_alone_take_the_max_of_the_logits_as_they_are():
    """A step of greedy rows without log-probs reads the max of bf16 logits without an fp32 copy: the same tokens
    as the fp32 path (the copy is exact), the first of tied maxima, FAILED for NaN / +inf / all -inf rows."""
    logits = _logits(6, seed=3).bfloat16()
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index
    logits[2, 3], logits[3, 8] = math.nan, math.inf
    logits[4] = -math.inf
    greedy = [SamplingParams(temperature=0.0)] * 6
    tokens, logprobs = sample(logits, greedy, [None] * 6, with_logprobs=False)
    assert logprobs is None
    first, last = (int(logits[i].float().argmax()) for i in (0, 5))
    assert tokens.tolist() == [first, 5, FAILED, FAILED, FAILED, last]
    full, _ = sample(logits, greedy, [None] * 6)  # with log-probs: through the fp32 copy
    assert torch.equal(tokens, full)


def test_greedy_rows_alone_take_the_maxima_their_logits_carry():
    """Logits carrying row maxima (a compiled decode step's, `attach_maxima`): greedy rows alone take them (here
    deliberately not the logits' own, to see which were read), their FAILED rows without writing into them; a
    sampled row, log-probs, a row subset or dropped maxima (`drop_maxima`, masking in place) read the logits."""
    logits = _logits(3, seed=4)
    own = logits.max(-1)
    maxes, tokens = torch.tensor([1.0, math.nan, 2.0]), torch.tensor([7, 8, 9])
    greedy = [SamplingParams(temperature=0.0)] * 3
    got, _ = sample(attach_maxima(logits, maxes, tokens), greedy, [None] * 3, with_logprobs=False)
    assert got.tolist() == [7, FAILED, 9] and tokens.tolist() == [7, 8, 9]
    assert torch.equal(sample(logits, greedy, [None] * 3)[0], own.indices)  # with log-probs
    mixed = [*greedy[:2], SamplingParams(temperature=1.0, seed=1)]
    assert (
        sample(logits, mixed, [None, None, torch.Generator().manual_seed(1)])[0][:2].tolist()
        == own.indices[:2].tolist()
    )
    assert torch.equal(sample(logits[:2], greedy[:2], [None] * 2, with_logprobs=False)[0], own.indices[:2])
    drop_maxima(logits)
    assert torch.equal(sample(logits, greedy, [None] * 3, with_logprobs=False)[0], own.indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_row_maxima_equal_the_eager_ones(dtype):
    """The maxima a compiled decode step carries (inductor's max over the vocabulary, as `DecodeGraph._step` takes
    it) equal eager `max(-1)`'s bit for bit, values and indices: the first of tied maxima, NaN and +inf rows.
    A maximum is one of the inputs and the index a comparison: exact by construction, no tolerance."""
    import functools

    from torch._inductor.compile_fx import compile_fx

    from flashnext.serve.decode_graph import INDUCTOR_PATCHES

    logits = _logits(5, seed=5).to(dtype)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1
    logits[2, 3], logits[3, 8] = math.nan, math.inf
    backend = functools.partial(compile_fx, config_patches=INDUCTOR_PATCHES)
    got = torch.compile(lambda x: x.max(-1), backend=backend, fullgraph=True, dynamic=False)(logits)
    want = logits.max(-1)
    assert torch.equal(got[1], want.indices)
    torch.testing.assert_close(got[0], want.values, rtol=0, atol=0, equal_nan=True)


def test_sampling_errors_are_reported_per_row():
    """An exception while sampling one row (here: its generator is not a generator) fails that row, with the
    reason, and no other."""
    logits = _logits(2)
    errors = {}
    params = [SamplingParams(temperature=1.0)] * 2
    tokens, _ = sample(logits, params, [torch.Generator().manual_seed(0), "not a generator"], errors=errors)
    assert int(tokens[1]) == FAILED and 0 <= int(tokens[0]) < V
    assert list(errors) == [1] and "sampling failed" in errors[1]


def test_choice_seeds():
    seeds = [choice_seed(5, i) for i in range(8)]
    assert seeds[0] == 5 and len(set(seeds)) == 8
    assert all(INT64_MIN <= s <= INT64_MAX for s in seeds + [choice_seed(INT64_MAX, 3), choice_seed(INT64_MIN, 3)])
    assert not set(seeds[1:]) & {choice_seed(6, i) for i in range(8)}  # neighbouring seeds share no choice
