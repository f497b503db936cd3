"""OwnerRoutedEmbedding on gloo (world sizes 1, 2, 4) against an unsharded `nn.Embedding`.

Every rank builds the same full table, every rank's ids and every rank's output cotangent from a shared seed, so it
can compute the reference (outputs and the full-table gradient of the summed loss) by itself and compare its own
output and its own rows' gradient slice. All cases of one world size run in one spawned group (spawning costs
seconds; the cases milliseconds); the tests then read their case's result.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_helpers import run_spawned
from torch import nn

from flashnext.errors import ConfigError, InputError
from flashnext.parallel import OwnerRoutedEmbedding, row_ranges, swap_ngram_embeddings

WORLD_SIZES = [1, 2, 4]

# name -> rows, dim, tokens(rank, world), layout, id dtype, id pool (None: all rows)
CASES = {
    "equal_tokens": dict(rows=64, tokens=lambda r, w: 16),
    "uneven_tokens": dict(rows=64, tokens=lambda r, w: 5 + 7 * r),
    "one_rank_empty": dict(rows=64, tokens=lambda r, w: 0 if r == w - 1 else 12),
    "all_ranks_empty": dict(rows=64, tokens=lambda r, w: 0),
    "vocab_indivisible": dict(rows=37, tokens=lambda r, w: 20),
    "empty_row_shards": dict(rows=3, tokens=lambda r, w: 10),
    "int32_ids": dict(rows=64, tokens=lambda r, w: 16, dtype=torch.int32),
    "ids_1d": dict(rows=64, tokens=lambda r, w: 30, layout="1d"),
    "ids_3d_noncontiguous": dict(rows=64, layout="3d"),
    "ids_scalar": dict(rows=64, layout="scalar"),
    "heavy_duplication": dict(rows=64, tokens=lambda r, w: 200, pool=[0, 1, 17, 33, 50, 63]),
}
DEDUP = {"dedup": True, "no_dedup": False}


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _case_inputs(name: str, world: int):
    """Full weight [rows, dim], then per rank: ids (the case's dtype and layout) and cotangent [*ids.shape, dim]."""
    case = {"dim": 8, "layout": "2d", "dtype": torch.int64, "pool": None, **CASES[name]}
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    weight = torch.randn(case["rows"], case["dim"], generator=g)
    ids, cots = [], []
    for r in range(world):
        if case["layout"] == "3d":  # [B, S, H] as a permuted view of a [H, S, B] tensor: not contiguous
            shape = (4, 5, 3 + r)
        elif case["layout"] == "scalar":
            shape = ()
        else:
            T = case["tokens"](r, world)
            shape = (T, 4) if case["layout"] == "2d" else (T,)
        if case["pool"] is None:
            x = torch.randint(0, case["rows"], shape, generator=g)
        else:
            pool = torch.tensor(case["pool"])
            x = pool[torch.randint(0, len(pool), shape, generator=g)]
        x = x.to(case["dtype"])
        if case["layout"] == "3d":
            x = x.permute(2, 1, 0)
        ids.append(x)
        cots.append(torch.randn(*x.shape, case["dim"], generator=g))
    return weight, ids, cots


def _expected_received(ids: list[torch.Tensor], start: int, end: int, dedup: bool) -> list[int]:
    """Ids each peer should send to the owner of rows [start, end): its distinct ids there with dedup, else all."""
    counts = []
    for x in ids:
        mine = x.reshape(-1)[(x.reshape(-1) >= start) & (x.reshape(-1) < end)]
        counts.append(int(mine.unique().numel() if dedup else mine.numel()))
    return counts


def _check_case(rank: int, world: int, name: str, dedup: bool) -> dict:
    weight, ids, cots = _case_inputs(name, world)
    ref = nn.Embedding.from_pretrained(weight, freeze=False)
    ref_outs = [ref(x.long()) for x in ids]
    sum((o * c).sum() for o, c in zip(ref_outs, cots, strict=True)).backward()

    emb = OwnerRoutedEmbedding(*weight.shape, dedup=dedup)
    with torch.no_grad():
        emb.weight.copy_(weight[emb.row_start : emb.row_end])
    out = emb(ids[rank])
    (out * cots[rank]).sum().backward()
    ref_grad = ref.weight.grad[emb.row_start : emb.row_end]
    return {
        "contiguous_input": ids[rank].is_contiguous(),
        "shape": (tuple(out.shape), tuple(ref_outs[rank].shape)),
        "out_equal": torch.equal(out, ref_outs[rank]),
        "grad_shape": (tuple(emb.weight.grad.shape), tuple(ref_grad.shape)),
        "grad_err": _max_abs(emb.weight.grad - ref_grad),
        "grad_scale": _max_abs(ref.weight.grad),
        "received": (emb.last_stats["received_per_peer"], _expected_received(ids, emb.row_start, emb.row_end, dedup)),
        "sent": (emb.last_stats["sent_ids"], int(ids[rank].unique().numel() if dedup else ids[rank].numel())),
        "out": out.detach(),
        "grad": emb.weight.grad.clone(),
    }


def _check_out_of_range(rank: int, world: int) -> dict:
    """The last rank (or rank 0 as well, with a negative id) passes a bad id: every rank must raise, then recover."""
    rows = 10
    emb = OwnerRoutedEmbedding(rows, 4)
    messages = {}
    for label, bad_ranks, bad_id in [("too_large", [world - 1], rows), ("negative", [0, world - 1], -3)]:
        ids = torch.arange(12).remainder(rows).reshape(3, 4)
        if rank in bad_ranks:
            ids[1, 3] = bad_id  # flat position 7
        try:
            emb(ids)
            messages[label] = None
        except InputError as e:
            messages[label] = str(e)
    out = emb(torch.arange(rows))  # the group is still usable afterwards
    out.sum().backward()
    messages["recovered"] = bool(torch.equal(out.detach()[emb.row_start : emb.row_end], emb.weight.detach()))
    return messages


def _check_swap_model(rank: int, world: int) -> dict:
    """The tiny model with its n-gram table swapped: same logits as unsharded, grads = slice of the full grad."""
    from flashnext.config import tiny_config
    from flashnext.model.text import FlashNextForCausalLM

    torch.manual_seed(0)
    model = FlashNextForCausalLM(tiny_config())
    model.init_weights(seed=0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (12 + 5 * r,), generator=g) for r in range(world)]
    ref_logits = []
    for ids in batches:
        out = model(ids)
        ref_logits.append(out.logits.detach())
        (out.logits.square().mean()).backward()
    names = [n for n, _ in model.named_modules() if n.endswith("ple_embedding.ngram_embedding")]
    full_grad = model.get_submodule(names[0]).weight.grad.clone()

    with torch.device("meta"):
        meta_model = FlashNextForCausalLM(tiny_config())
    meta_table = meta_model.get_submodule(swap_ngram_embeddings(meta_model)[0])

    model.zero_grad()
    swapped = swap_ngram_embeddings(model)
    table = model.get_submodule(swapped[0])
    out = model(batches[rank])
    out.logits.square().mean().backward()
    return {
        "names": (swapped, names),
        "type": type(table).__name__,
        "logits_equal": torch.equal(out.logits.detach(), ref_logits[rank]),
        "grad_err": _max_abs(table.weight.grad - full_grad[table.row_start : table.row_end]),
        "grad_scale": _max_abs(full_grad),
        "local_rows": (table.weight.shape[0], full_grad.shape[0]),
        "meta_weight": (meta_table.weight.device.type, tuple(meta_table.weight.shape), tuple(table.weight.shape)),
    }


def _run_all(rank: int, world: int) -> dict:
    results = {(name, mode): _check_case(rank, world, name, dedup) for name in CASES for mode, dedup in DEDUP.items()}
    results["out_of_range"] = _check_out_of_range(rank, world)
    results["swap_model"] = _check_swap_model(rank, world)
    return results


@functools.cache
def _results(world: int) -> list[dict]:
    return run_spawned(_run_all, world, timeout_s=120)


@pytest.mark.parametrize("mode", DEDUP)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parity_with_unsharded_embedding(world, case, mode):
    for rank, res in enumerate(_results(world)):
        r = res[(case, mode)]
        assert r["shape"][0] == r["shape"][1], (rank, r["shape"])
        assert r["out_equal"], f"rank {rank}: output differs from nn.Embedding"
        assert r["grad_shape"][0] == r["grad_shape"][1], (rank, r["grad_shape"])
        assert r["grad_err"] <= 1e-6 * max(1.0, r["grad_scale"]), (rank, r["grad_err"])
        got, expected = r["received"]
        assert got == expected, f"rank {rank} received per peer {got}, expected {expected}"
        assert r["sent"][0] == r["sent"][1], (rank, r["sent"])
        if case == "ids_3d_noncontiguous":
            assert not r["contiguous_input"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_dedup_on_and_off_agree(world, case):
    for res in _results(world):
        on, off = res[(case, "dedup")], res[(case, "no_dedup")]
        assert torch.equal(on["out"], off["out"])
        # Only the fp32 summation order of duplicate ids' gradients differs.
        assert _max_abs(on["grad"] - off["grad"]) <= 1e-6 * max(1.0, on["grad_scale"])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_heavy_duplication_sends_each_id_once_per_peer(world):
    for res in _results(world):
        on, off = res[("heavy_duplication", "dedup")], res[("heavy_duplication", "no_dedup")]
        assert on["sent"][0] <= 6 < off["sent"][0]  # 6 distinct ids among 800
        assert all(n <= 6 for n in on["received"][0])
        assert sum(on["received"][0]) < sum(off["received"][0])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_out_of_range_id_raises_on_every_rank(world):
    for rank, msgs in enumerate(_results(world)):
        for label, bad_id, bad_ranks in [("too_large", 10, [world - 1]), ("negative", -3, sorted({0, world - 1}))]:
            msg = msgs["out_of_range"][label]
            assert msg is not None, f"rank {rank} did not raise for {label}"
            for b in bad_ranks:
                assert f"rank {b}: id {bad_id} at flat position 7" in msg, msg
            assert "[0, 10)" in msg
        assert msgs["out_of_range"]["recovered"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_swap_ngram_embeddings_in_tiny_model(world):
    for rank, res in enumerate(_results(world)):
        r = res["swap_model"]
        swapped, names = r["names"]
        assert swapped == names and len(names) == 1
        assert r["type"] == "OwnerRoutedEmbedding"
        assert r["logits_equal"], f"rank {rank}: logits changed by the swap"
        assert r["grad_err"] <= 1e-6 * max(1.0, r["grad_scale"]), (rank, r["grad_err"])
        local, full = r["local_rows"]
        start, end = row_ranges(full, world)[rank]
        assert local == end - start
        device, meta_shape, shape = r["meta_weight"]
        assert device == "meta" and meta_shape == shape


def test_row_ranges_split():
    assert row_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert row_ranges(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert row_ranges(8, 2) == [(0, 4), (4, 8)]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(padding_idx=0), "padding_idx"),
        (dict(max_norm=1.0), "max_norm"),
        (dict(scale_grad_by_freq=True), "scale_grad_by_freq"),
        (dict(sparse=True), "sparse"),
    ],
)
def test_rejected_options(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        OwnerRoutedEmbedding(10, 4, **kwargs)
    with pytest.raises(ConfigError, match=name):
        OwnerRoutedEmbedding.from_embedding(nn.Embedding(10, 4, **kwargs))


def test_model_package_never_imports_torch_distributed():
    from pathlib import Path

    import flashnext.model

    offenders = [
        p.name for p in Path(flashnext.model.__file__).parent.glob("*.py") if "torch.distributed" in p.read_text()
    ]
    assert offenders == [], f"model files importing torch.distributed: {offenders}"
