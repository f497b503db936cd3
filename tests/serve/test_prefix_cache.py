"""The prefix cache (`serve.prefix_cache`): outputs with it equal outputs without it, and it hits where it should.

The twin is the same engine with `prefix_cache=False`. With a step budget of one block (B tokens) both engines
cut every prompt into the same chunks (the cache ends chunks at block boundaries, which a budget of B does anyway),
and a resumed state is a copy of the state computed at that boundary, so tokens, log-probs and the slot's whole
state after the prefill are bitwise equal. With another budget the chunking differs, and only fp32 rounding of a
different chunking separates them (`TOL`).
"""

from __future__ import annotations

import logging

import httpx
import pytest
import torch
from serve_helpers import running_server, small_model, tiny_composite
from spec_helpers import spec_model

from flashnext.cli import _serve_app, build_parser
from flashnext.errors import ConfigError
from flashnext.serve.engine import Engine
from flashnext.serve.prefix_cache import PrefixCache, prefix_cache_line
from flashnext.serve.sampling import SamplingParams

B = 64  # the smallest block the GDN chunk allows
TOL = 1e-4  # log-prob gap from a different prefill chunking: fp32 rounding through 4 layers of a small model


def greedy(k: int = 0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0, num_speculative_tokens=k,
                          **kw)  # fmt: skip


@pytest.fixture(scope="module")
def model(small_config_module):
    return small_model(small_config_module)


@pytest.fixture(scope="module")
def mtp_model(small_config_module):
    return spec_model(small_config_module)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(4, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BASE = ids(0, 200)


def make(model, on: bool, budget: int = B, **kw) -> Engine:
    return Engine(model, None, max_slots=4, max_model_len=320, max_num_batched_tokens=budget, prefix_cache=on,
                  prefix_block_size=B, **kw)  # fmt: skip


def state_after_prefill(engine: Engine, prompt: list[int], params: SamplingParams):
    """Run `prompt` alone; the slot's state right after its first token (positional rows up to the prompt's
    length: later rows are scratch) and the finished completion."""
    req = engine.add_request(prompt, params)
    state = None
    while not req.finished:
        engine.step()
        if state is None and req.output_ids and not req.finished:
            state = slot_rows(engine, req.slot, len(prompt))
    return state, req.completion(False)


def slot_rows(engine: Engine, slot: int, length: int) -> list[torch.Tensor]:
    pc = engine.prefix_cache or PrefixCache(engine.cache, engine.model, B, 0)  # its view of the buffers
    rows = [buf[slot].clone() for buf in pc.states]
    return rows + [buf[slot, : length // per].clone() for buf, per, _ in pc.positional]


def run_both(model, prompts, params, budget: int = B, **kw):
    """Each prompt alone, in order, on a cache-off and a cache-on engine: (off, on) completions and states."""
    out = []
    for on in (False, True):
        engine = make(model, on, budget, **kw)
        out.append([state_after_prefill(engine, p, params) for p in prompts])
    return out[0], out[1], engine


def assert_same(off, on, bitwise: bool = True):
    for (s_off, c_off), (s_on, c_on) in zip(off, on, strict=True):
        assert c_on.token_ids == c_off.token_ids
        gap = max(abs(a - b) for a, b in zip(c_on.logprobs, c_off.logprobs, strict=True))
        assert gap == 0.0 if bitwise else gap < TOL, gap
        if bitwise:
            for a, b in zip(s_on, s_off, strict=True):
                assert torch.equal(a, b)


def test_block_multiples_and_one_off(model):
    """Prompts at 2B - 1, 2B, 2B + 1 tokens (the lengths where align-mode caches lose their hit), after a warm-up
    prompt that shares them: bitwise equal to the cache-off run, and each resumes from the deepest snapshot."""
    prompts = [BASE[:150], BASE[: 2 * B + 1], BASE[: 2 * B], BASE[: 2 * B - 1], BASE[: 2 * B]]
    off, on, engine = run_both(model, prompts, greedy())
    assert_same(off, on)
    # 150 snapshots at 128; 129 resumes there; 128 must feed a token, so only a block-1 snapshot would do (none yet;
    # it takes one at 64 and, free, at 128); 127 resumes at 64; 128 again now resumes at 64.
    assert [c.cached_tokens for _, c in on] == [0, 2 * B, 0, B, B]
    assert [c.cached_tokens for _, c in off] == [0] * 5
    s = engine.prefix_cache.stats
    assert s.cached_tokens == 4 * B and s.prompt_tokens == sum(map(len, prompts))


def test_other_chunking_within_rounding(model):
    """A budget that is not a block: the cache-on engine's chunks end elsewhere; same tokens, log-probs within TOL."""
    prompts = [BASE[:150], BASE[:150] + [5, 6, 7], BASE[:100] + ids(1, 70)]
    off, on, _ = run_both(model, prompts, greedy(), budget=100)
    assert_same(off, on, bitwise=False)
    assert [c.cached_tokens for _, c in on] == [0, 2 * B, 0]  # the third shares block 0, which has no snapshot


def test_hit_ending_inside_unique_tokens(model):
    """Few-shot / RL-group shape: a 100-token shared prefix, then unique tokens. The first prompt's snapshot (128)
    lies in its unique tokens; the second puts one at the junction (64), where the third resumes."""
    prompts = [BASE[:100] + ids(s, 60) for s in (1, 2, 3, 4)]
    off, on, _ = run_both(model, prompts, greedy())
    assert_same(off, on)
    assert [c.cached_tokens for _, c in on] == [0, 0, B, B]


def test_two_sharers_in_one_step_then_a_third(model):
    prompts = [BASE[:150], BASE[:140] + [9] * 10]
    params = greedy()
    off = make(model, False).generate(prompts, params)
    engine = make(model, True, budget=512)
    on = engine.generate(prompts, params)  # admitted together: neither can use the other's blocks yet
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < TOL
    assert [c.cached_tokens for c in on] == [0, 0]
    assert engine.prefix_cache.blocks  # both inserted the same blocks once
    third = engine.generate([BASE[:150] + [1, 2]], params)[0]
    assert third.cached_tokens == 2 * B


def test_eviction_while_a_sharer_runs(model):
    """A budget of about three blocks: while a request resumed from the cached path decodes, others insert blocks
    and evict; the path it holds is never evicted under it, and its output is the cache-off one."""
    params = greedy()
    probe = make(model, True)
    probe.generate([BASE[:150]], params)
    per_block = probe.prefix_cache.nbytes / 2
    engine = make(model, True, budget=B, prefix_cache_mb=3.2 * per_block / 2**20)
    engine.generate([BASE[:150]], params)
    sharer = engine.add_request(BASE[:150] + [7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                                  logprobs=0))  # fmt: skip
    engine.step()
    path = list(engine.prefix_cache.plans[sharer].path)
    others = [ids(10 + i, 140) for i in range(3)]
    for p in others:
        engine.add_request(p, params)
    while not sharer.finished:
        engine.step()
        assert all(blk.key in engine.prefix_cache.blocks for blk in path)
    assert engine.prefix_cache.stats.evicted > 0  # while the sharer ran
    while engine.has_unfinished():
        engine.step()
    assert engine.prefix_cache.nbytes <= engine.prefix_cache.budget
    ref = make(model, False).generate([BASE[:150] + [7]], sharer.params)[0]
    assert sharer.completion(False).cached_tokens == 2 * B
    assert sharer.output_ids == ref.token_ids  # decoded beside others here, alone there: rounding may differ
    assert max(abs(a - b) for a, b in zip(sharer.logprobs, ref.logprobs, strict=True)) < TOL


def test_weight_update_between_turns_never_hits_stale(small_config):
    """A weight load between two turns (the version number left unchanged, as a sync without one does): the
    second turn prefills from scratch under the new weights, and the old blocks are gone."""
    model = small_model(small_config)
    engine = make(model, True)
    params = greedy()
    engine.generate([BASE[:150]], params)
    assert engine.prefix_cache.blocks
    new = {name: p.detach() * 1.01 for name, p in model.named_parameters() if p.dim() > 1}
    engine.load_weights(list(new.items()))
    turn2 = engine.generate([BASE[:150] + [5, 6]], params)[0]
    assert turn2.cached_tokens == 0
    fresh = make(model, False).generate([BASE[:150] + [5, 6]], params)[0]
    assert turn2.token_ids == fresh.token_ids and turn2.logprobs == fresh.logprobs
    assert all(blk.root == engine.prefix_cache._root for blk in engine.prefix_cache.blocks.values())
    engine.weight_version = engine.weight_version  # an update route setting the same number still invalidates
    assert engine.generate([BASE[:150] + [5, 6]], params)[0].cached_tokens == 0


def test_speculative_keeps_the_last_block(mtp_model):
    """MTP on: a resumed request keeps every cached block. The head's cell of the last resumed position pairs it
    with the next token, which the block's key does not cover (the second prompt's differs from the first's): it is
    recomputed from the residual kept with the snapshot, so the head's cells equal the cache-off run's. (The
    cache-off run feeds its last prompt token with drafts and replays it after a rejection, so its steps differ from
    the resumed run's: rounding, TOL.)"""
    prompts = [BASE[:150], BASE[: 2 * B] + ids(6, 25), BASE[:150] + [5, 6, 7], BASE[: 2 * B], BASE[: 2 * B + 1],
               BASE[:100] + ids(5, 60)]  # fmt: skip
    off, on, engine = run_both(mtp_model, prompts, greedy(k=2))
    assert_same(off, on, bitwise=False)
    assert [c.cached_tokens for _, c in on] == [0, 2 * B, 2 * B, 0, 2 * B, B]
    n_states = len(engine.prefix_cache.states)
    for (s_off, _), (s_on, _) in zip(off, on, strict=True):  # positional rows: the trunk's and the head's cells
        for a, b in zip(s_on[n_states:], s_off[n_states:], strict=True):
            assert (a - b).abs().max() < TOL


def test_n_choices_and_routed_experts(model):
    """n = 3 sampled choices of a resumed prompt, with routed experts: the cache-off run's tokens and experts
    (the resumed prompt positions report the experts recorded when their block was computed)."""
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3, return_routed_experts=True, logprobs=0)
    prompts = [BASE[:150], BASE[:150] + [8, 9]]
    outs = []
    for on in (False, True):
        engine = make(model, on)
        outs.append([engine.generate([p], params) for p in prompts][-1])
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert torch.equal(a.routed_experts, b.routed_experts)
    assert [c.cached_tokens for c in outs[1]] == [2 * B] * 3


def test_prompt_logprobs_are_never_resumed(model):
    engine = make(model, True)
    engine.generate([BASE[:150]], greedy())
    scored = engine.generate([BASE[:150]], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert scored.cached_tokens == 0 and len(scored.prompt_logprobs) == 150


def test_block_size_must_fit_the_chunk_and_the_qsa_block(model):
    with pytest.raises(ConfigError, match="block size 96"):
        Engine(model, None, max_slots=2, max_model_len=128, prefix_block_size=96)
    assert Engine(model, None, max_slots=2, max_model_len=128, prefix_cache=False).prefix_cache is None


def test_visible_over_http_metrics_and_logs(caplog):
    """The second request of a shared 150-token prompt reports `usage.prompt_tokens_details.cached_tokens`, /metrics
    counts it, and the server logs it (per request and in the periodic line); `serve` flags build the engine."""
    caplog.set_level(logging.INFO, logger="flashnext.serve")
    flags = ["--max-slots", "2", "--max-model-len", "256", "--threads", "1", "--max-batched-tokens", "64",
             "--prefix-block-size", "64", "--prefix-cache-mb", "8"]  # fmt: skip
    assert _serve_app(build_parser().parse_args(["serve", "--no-prefix-cache", *flags]))[2].prefix_cache is None
    app, name, engine = _serve_app(build_parser().parse_args(["serve", *flags]))
    assert engine.prefix_cache.B == 64 and engine.prefix_cache.budget == 8 * 2**20
    prompt = ids(7, 150)
    with running_server(app) as base:
        body = {"model": name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        first, second = (httpx.post(f"{base}/v1/completions", json=body, timeout=60).json() for _ in range(2))
        text = httpx.get(f"{base}/metrics").text
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 128}
    assert "flashnext_prefix_cache_cached_tokens_total 128\n" in text
    assert "flashnext_prefix_cache_prompt_tokens_total 300\n" in text
    assert f"flashnext_prefix_cache_hit_rate {128 / 300:.6f}" in text
    assert "flashnext_prefix_cache_evictions_total 0" in text
    logged = [r.getMessage() for r in caplog.records]
    assert any(second["id"] in m and "128 prompt tokens cached" in m for m in logged)
    assert prefix_cache_line(engine.prefix_cache).startswith("prefix cache: 128/300 prompt tokens reused (42.7%)")


def test_image_tokens_hash_by_image_content():
    """The same ids with other pixels share only the blocks before the image (the second request snapshots at that
    junction); the same pixels again hit through the image. Every output is the cache-off engine's."""
    model = tiny_composite()
    grid = torch.tensor([[1, 4, 6]])  # 6 merged tokens
    pixels = [torch.randn(24, 96, generator=torch.Generator().manual_seed(s)) for s in (2, 3)]
    prompt = ids(8, 70) + [512, *[514] * 6, 513] + ids(9, 60)  # the image at 70..77, in block 1
    order = [0, 1, 0, 1]
    outs = []
    for on in (False, True):
        engine = make(model, on)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
        reqs = []
        for k in order:
            req = engine.add_request(prompt, params, pixel_values=pixels[k], image_grid_thw=grid)
            while not req.finished:
                engine.step()
            reqs.append(req.completion(False))
        outs.append(reqs)
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert outs[0][0].logprobs != outs[0][1].logprobs  # the images matter
    assert [c.cached_tokens for c in outs[1]] == [0, 0, 2 * B, 2 * B]


def test_lru_evicts_the_least_recently_used_leaf(model):
    """Three 2-block paths over a budget of 2.5 paths: the one not used since it was inserted loses its leaf (the
    block with the snapshot, more than half a path), its parent stays; the older but recently hit path stays."""
    params = greedy()
    probe = make(model, True)
    probe.generate([ids(20, 150)], params)
    path_bytes = probe.prefix_cache.nbytes
    engine = make(model, True, prefix_cache_mb=2.5 * path_bytes / 2**20)
    a, b, c = ids(20, 150), ids(21, 150), ids(22, 150)
    engine.generate([a], params)
    engine.generate([b], params)
    assert engine.generate([a + [1, 2]], params)[0].cached_tokens == 2 * B  # a is used again: b is now the LRU
    engine.generate([c], params)
    pc = engine.prefix_cache
    ka, kb, kc = (pc.keys(engine.add_request(p, SamplingParams(max_tokens=1))) for p in (a, b, c))
    assert all(k in pc.blocks for k in ka + kc)
    assert kb[0] in pc.blocks and kb[1] not in pc.blocks
    assert pc.stats.evicted == 1 and pc.nbytes <= pc.budget


@pytest.mark.slow  # dynamo traces the decode step once per engine (~40 s each on the shared box)
def test_decode_graph_after_a_hit(model):
    """A resumed request decodes through the decode graph (eager backend: the same fixed-shape step) as without the
    cache."""
    prompts = [BASE[:150], BASE[:150] + [4, 5]]
    kw = dict(decode_graph=True, decode_buckets=[1], compile_backend="eager")
    plain = make(model, False, **kw)
    off = [plain.generate([p], greedy())[0] for p in prompts]
    engine = make(model, True, **kw)
    on = [engine.generate([p], greedy())[0] for p in prompts]
    assert [c.cached_tokens for c in on] == [0, 2 * B]
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_drafts_never_ride_into_a_snapshot_point(mtp_model):
    """A step budget of 63 ends a 128-token prompt's chunk at 127, after which its head drafts; the chunk to the
    block-aligned end (128) is cut there by the snapshot point, which leaves the drafts out (`Scheduler.chunk`), so
    the snapshot is the state after 128 tokens: the next prompt resumes there with the cache-off tokens."""
    prompts = [BASE[: 2 * B], BASE[: 2 * B] + [9, 9]]
    off = [make(mtp_model, False, budget=63).generate([p], greedy(k=2))[0] for p in prompts]
    engine = make(mtp_model, True, budget=63)
    on = [engine.generate([p], greedy(k=2))[0] for p in prompts]
    assert on[0].num_draft_tokens > 0
    assert [c.cached_tokens for c in on] == [0, 2 * B]
    for a, b in zip(off, on, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < TOL
