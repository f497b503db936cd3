"""NF4 n-gram rows: the Lloyd-Max levels, the scale search and the packed lookup against plain references."""

from __future__ import annotations

import math

import torch

from flashnext.ngram.nf4 import NF4_LEVELS, SCALE_GRID, NF4NGramTable, dequantize_nf4, quantize_nf4


def test_levels_are_the_lloyd_max_quantiser_of_a_unit_gaussian():
    levels = NF4_LEVELS.double().tolist()
    # Max (1960), 16 levels: +-0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326.
    published = [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326]
    assert [round(x, 3) for x in levels[8:]] == [round(x, 3) for x in published]
    assert all(abs(a + b) < 1e-6 for a, b in zip(levels, reversed(levels), strict=True))
    # The centroid condition: each level is the mean of N(0, 1) over its cell (midpoints of the levels).
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    edges = [-40.0, *((a + b) / 2 for a, b in zip(levels, levels[1:], strict=False)), 40.0]
    for level, a, b in zip(levels, edges[:-1], edges[1:], strict=True):
        assert abs((pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) - level) < 1e-5


def _reference(rows: torch.Tensor) -> torch.Tensor:
    """Row by row, value by value: the best grid scale (fp16) and each value's nearest level; -> dequantised."""
    out = torch.empty_like(rows)
    levels = NF4_LEVELS.tolist()
    for i, row in enumerate(rows.tolist()):
        rms = math.sqrt(sum(v * v for v in row) / len(row))
        best = None
        for f in SCALE_GRID:
            s = float(torch.tensor(rms * f, dtype=torch.float32).to(torch.float16))
            q = [min(levels, key=lambda lv, v=v: (abs(v / s - lv), lv)) * s if s else 0.0 for v in row]
            err = sum((a - b) ** 2 for a, b in zip(q, row, strict=True))
            if best is None or err < best[0]:
                best = (err, q)
        out[i] = torch.tensor(best[1])
    return out


def test_quantize_and_lookup_equal_the_plain_reference():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 16, generator=gen) * torch.rand(12, 1, generator=gen)
    rows[3] = 0.0  # an all-zero row
    rows[5, 7] = 9.0  # an outlier: the scale search trades it against the rest
    codes, scale = quantize_nf4(rows)
    assert codes.dtype == torch.uint8 and codes.shape == (12, 8) and scale.dtype == torch.float16
    deq = dequantize_nf4(codes, scale, torch.float32)
    torch.testing.assert_close(deq, _reference(rows), rtol=1e-6, atol=1e-7)  # fp32 level*scale vs python floats
    assert torch.equal(deq[3], torch.zeros(16))

    table = NF4NGramTable(12, 16, dtype=torch.float32)
    table.fill(0, rows[:5])
    table.fill(5, rows[5:])
    ids = torch.tensor([[11, 0, 5], [5, 5, 2]])
    assert torch.equal(table(ids), deq[ids])
    table.to(torch.bfloat16)  # output dtype follows; the codes and fp16 scales stay
    assert table.codes.dtype == torch.uint8 and table.row_scale.dtype == torch.float16
    assert torch.equal(table(ids), deq[ids].to(torch.bfloat16))


def test_error_on_gaussian_rows_beats_the_plain_rms_scale():
    rows = torch.randn(2000, 160, generator=torch.Generator().manual_seed(1)) * 0.02
    codes, scale = quantize_nf4(rows)
    power = rows.square().mean()
    err = float((dequantize_nf4(codes, scale, torch.float32) - rows).square().mean() / power)
    rms = rows.square().mean(-1, keepdim=True).sqrt().to(torch.float16).float()  # the scale without a search
    edges = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
    plain = float((NF4_LEVELS[torch.bucketize(rows / rms, edges)] * rms - rows).square().mean() / power)
    # Lloyd-Max 16 levels on N(0, 1) have MSE 0.009497 (20.2 dB); fitting each row's scale does better (0.0081).
    assert 0.0090 < plain < 0.0100 and 0.0070 < err < plain
    assert codes.nbytes + scale.nbytes == 2000 * (80 + 2)  # 82 bytes per 160-wide row (FP8: 160, BF16: 320)
