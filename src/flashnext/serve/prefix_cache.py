"""Automatic prefix cache for a hybrid (GDN + QSA + PLE) model: reuse a shared prompt prefix exactly.

A prompt is cut into blocks of B tokens (B a multiple of the GDN chunk and of the QSA block `compress_ratio`, so a
block boundary is a chunk and QSA block boundary). Block i's key hashes the key of block i - 1 and its tokens
(plus, for a prompt with images, the images' content from the block holding the first image token on: image
features replace those tokens' embeddings, so the ids alone do not fix the state), rooted in the weights' identity
(`weight_version` and a generation bumped by every weight load): a key fixes everything the state after the block
depends on. Per cached block we keep:
- `rows`: the positional state of its positions (every QSA layer's keys, values, raw and pooled index keys; the
  MTP head's QSA cells when `mtp` is set), copied out of the slot once the block is prefilled;
- optionally a `snapshot`: every window and recurrent state of the slot after the block's last token (each GDN
  layer's recurrent and conv state, the PLE conv tail and n-gram context), and the trunk's pre-final-mixer residual
  of that last token (the MTP head's input, to recompute its last cell: see below).

A recurrence can only resume where a snapshot exists, so *where* to snapshot decides the hit rate. A request takes
one (a) at the end of the last full block strictly before its prompt's end (its own repeat, a resent history and
a longer next turn hit there), (b) at its prompt's end when that is a block boundary (free: the prefill ends there),
and (c) at the junction: the end of the last block it shares with the cached path, when that has no snapshot yet
(the second prompt sharing a few-shot prefix or an RL group's prompt puts one where the paths diverge, so a
snapshot never sits only in one request's unique tokens). The scheduler ends prefill chunks at those points
(`limit`), a chunk boundary being the only place the state after a token exists.

On admission (`admit`) a request resumes at the deepest matched block with a snapshot whose end is before the
prompt's end (one token at least is fed: its logits give the first sampled token) and, for a speculating request,
whose every block carries MTP cells and which kept the residual: the blocks' positional rows and the snapshot are
copied into the request's slot (never aliased: the live state is the slot's own), `num_cached` starts there and
the rest is prefilled. The MTP head's cell of the last resumed position pairs the residual there with the *next*
token, which the block key does not cover: that cell is recomputed from the kept residual (`resume_residual`,
`serve.speculative`), so a hit under MTP keeps its last block.

Lifetime: a request holds a reference on every block of its path (matched and inserted) until it ends, so its
path's prefix is never evicted under it; when the cache's bytes exceed the budget, unreferenced leaves go, least
recently used first; blocks of older weights (a weight load, or a new `weight_version`) are dropped as soon as they
are unreferenced, and can never hit (their keys have another root).

Parts: the block store (`serve.prefix_blocks`: blocks, bytes, references, eviction); the keys (`block_keys`);
the slot copies (`_SlotView`: rows and snapshots out of a slot, a resumed path into one); `PrefixCache` decides
what to resume, snapshot and insert.

Legend: B block size, P prompt length, s resume position, e a request's prefilled length.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from flashnext.errors import ConfigError
from flashnext.model.state import POSITIONAL
from flashnext.ops.deltanet import CHUNK
from flashnext.serve.cache import StateCache
from flashnext.serve.prefix_blocks import Block, BlockStore, PrefixStats
from flashnext.serve.request import Request

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_BUDGET_MB", "PrefixCache", "PrefixStats", "block_keys", "prefix_cache_line",
           "prometheus_lines", "weights_root"]  # fmt: skip

DEFAULT_BLOCK_SIZE = 256  # tokens per block: 4 GDN chunks; a GDN snapshot costs ~2-4k tokens of QSA K/V (PREFIX.md)
DEFAULT_BUDGET_MB = 1024.0


@dataclass(eq=False)
class _Plan:
    """A request's walk along the cache: its blocks' keys, the path it holds, where it snapshots."""

    keys: list[bytes]
    path: list[Block] = field(default_factory=list)  # blocks 0 .. len(path)-1 of its prompt, referenced
    points: list[int] = field(default_factory=list)  # snapshot positions still ahead, ascending
    pending: dict[int, tuple[list[torch.Tensor], torch.Tensor | None]] = field(default_factory=dict)


def _check_block_size(block_size: int, ratio: int) -> None:
    if block_size < 1 or block_size % CHUNK or (ratio and block_size % ratio):
        raise ConfigError(
            f"prefix cache block size {block_size} must be a positive multiple of the GDN chunk ({CHUNK}) and of "
            f"the QSA block (indexer_compress_ratio={ratio})"
        )


# ---- keys ----------------------------------------------------------------------------------------------------
def weights_root(weight_version: int, generation: int) -> bytes:
    """The key every path hashes from: the weights' identity (a new one makes every cached key unreachable)."""
    return hashlib.blake2b(f"flashnext-prefix/{weight_version}/{generation}".encode(), digest_size=16).digest()


def block_keys(root: bytes, ids: list[int], B: int, images=None, image_token_id: int | None = None) -> list[bytes]:
    """One key per full block of the prompt `ids` (see the module doc); `images`: the request's (pixels, grid),
    hashed into every block from the one holding the first `image_token_id` on."""
    first_image = None
    if images is not None:  # the images' content from the block of the first image token on
        first_image = next((i for i, t in enumerate(ids) if t == image_token_id), 0)
        pixels, grid = images
        h = hashlib.blake2b(digest_size=16)
        h.update(pixels.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        h.update(grid.detach().cpu().to(torch.int64).numpy().tobytes())
        image_key = h.digest()
    out, key = [], root
    for i in range(len(ids) // B):
        h = hashlib.blake2b(key, digest_size=16)
        h.update(torch.tensor(ids[i * B : (i + 1) * B], dtype=torch.int64).numpy().tobytes())
        if first_image is not None and first_image < (i + 1) * B:
            h.update(image_key)
        key = h.digest()
        out.append(key)
    return out


# ---- slot copies ---------------------------------------------------------------------------------------------
class _SlotView:
    """The cache buffers a block copies out of a slot and back: the positional ones (`positional`: buffer, tokens
    per row (1, or c for the pooled index keys), of the MTP head), a slice per block, and the window and recurrent
    ones (`states`), whose row after a block's last token is its snapshot."""

    def __init__(self, cache: StateCache, n_mtp: int, B: int):
        self.B = B
        kinds = {id(b): k for b, k in cache.kinds()}
        found = []  # (buffer, is positional, of the MTP head), in layer order
        for li, layer in enumerate(cache.layers):
            for part in layer.values():
                for buf in vars(part).values():
                    found.append((buf, kinds[id(buf)] == POSITIONAL, li >= len(cache.layers) - n_mtp))
        longest = max((b.shape[1] for b, pos, _ in found if pos), default=1)
        self.positional = [(b, longest // b.shape[1], m) for b, pos, m in found if pos]
        self.states = [b for b, pos, _ in found if not pos]

    def rows(self, slot: int, i: int, with_mtp: bool) -> list[torch.Tensor]:
        """Block i's positional rows of `slot` (copies; the MTP head's empty unless `with_mtp`)."""
        B = self.B
        return [buf[slot, i * B // per : (i + 1) * B // per].clone() if with_mtp or not is_mtp
                else buf.new_empty((0,)) for buf, per, is_mtp in self.positional]  # fmt: skip

    def mtp_rows(self, slot: int, i: int) -> dict[int, torch.Tensor]:
        """Block i's rows of `slot` in the MTP head's positional buffers, by buffer index (copies)."""
        B = self.B
        return {j: buf[slot, i * B // per : (i + 1) * B // per].clone()
                for j, (buf, per, is_mtp) in enumerate(self.positional) if is_mtp}  # fmt: skip

    def snapshot(self, slot: int) -> list[torch.Tensor]:
        """The slot's window and recurrent state now (copies)."""
        return [buf[slot].clone() for buf in self.states]

    def load(self, slot: int, blocks: list[Block], with_mtp: bool) -> None:
        """Copy the blocks' positional rows (the MTP head's only `with_mtp`) and the last one's snapshot into
        `slot`."""
        for j, (buf, per, is_mtp) in enumerate(self.positional):
            if is_mtp and not with_mtp:
                continue
            rows = torch.cat([blk.rows[j] for blk in blocks]) if len(blocks) > 1 else blocks[0].rows[j]
            buf[slot, : len(blocks) * self.B // per].copy_(rows)
        for buf, row in zip(self.states, blocks[-1].snapshot, strict=True):
            buf[slot].copy_(row)


class PrefixCache:
    """Blocks of prompt state by prefix key over a `StateCache` (see the module doc).

    Args:
        cache: the engine's state cache (rows are copied out of and into its slots).
        model: the served model (its MTP head's layer count, its image token id).
        block_size: B, tokens per block.
        budget_mb: bytes kept, in MiB (blocks past it are evicted, least recently used unreferenced leaves first).
    """

    def __init__(self, cache: StateCache, model, block_size: int = DEFAULT_BLOCK_SIZE,
                 budget_mb: float = DEFAULT_BUDGET_MB):  # fmt: skip
        cfg = getattr(model.config, "text", model.config)
        ratio = int(getattr(cfg, "indexer_compress_ratio", 0) or 0)
        _check_block_size(block_size, ratio)
        if budget_mb < 0:
            raise ConfigError(f"prefix cache budget must be >= 0 MiB, got {budget_mb}")
        self.cache, self.B, self.budget = cache, block_size, int(budget_mb * 2**20)
        mtp = getattr(model, "mtp", None)
        self.image_token_id = getattr(model, "image_token_id", None)  # composite models
        self.slots = _SlotView(cache, 0 if mtp is None else len(mtp.layers), block_size)
        self.positional, self.states = self.slots.positional, self.slots.states
        self.plans: dict[Request, _Plan] = {}
        self.stats = PrefixStats()
        self.weight_version, self.generation = 0, 0
        self.store = BlockStore(self.budget, self.stats, weights_root(0, 0))
        self.blocks = self.store.blocks  # the store's (one dict, never rebound)

    @property
    def nbytes(self) -> int:
        """Bytes of the cached blocks."""
        return self.store.nbytes

    @property
    def _root(self) -> bytes:
        return self.store.root

    def set_weights(self, weight_version: int, generation: int) -> None:
        """The weights' identity; a change makes every block stale (dropped once unreferenced)."""
        if (weight_version, generation) != (self.weight_version, self.generation):
            self.weight_version, self.generation = weight_version, generation
            self.store.set_root(weights_root(weight_version, generation))

    def keys(self, req: Request) -> list[bytes]:
        """One key per full block of the prompt (see the module doc)."""
        return block_keys(self.store.root, req.prompt_ids, self.B, req.images, self.image_token_id)

    # ---- admission -----------------------------------------------------------------------------------
    @torch.no_grad()
    def admit(self, req: Request) -> None:
        """Resume a newly admitted request (its slot allocated, empty) from the deepest usable cached block and
        plan its snapshots; sets `num_cached` (and the MTP resume state of a speculating request)."""
        B, P = self.B, len(req.prompt_ids)
        plan = _Plan(self.keys(req))
        self.plans[req] = plan
        matched = self.store.match(plan.keys)
        d = 0
        routed = req.params.return_routed_experts
        for i, blk in enumerate(matched):
            if (req.spec_k and not blk.mtp) or (routed and blk.routing is None):
                break
            if req.params.prompt_logprobs is not None:  # every prompt position is to be scored: no resume
                break
            if blk.snapshot is not None and (i + 1) * B < P and (not req.spec_k or blk.residual is not None):
                d = i + 1
        self.store.hold(matched)
        plan.path = matched
        if d:
            self._load(req, matched[:d])
        s = d * B
        points = {(P - 1) // B * B}
        if P % B == 0:
            points.add(P)
        if len(matched) > d and len(matched) * B <= P:
            points.add(len(matched) * B)  # the junction with the cached path
        plan.points = sorted(p for p in points if s < p <= P and p > 0)
        req.num_cached = req.num_cached_prompt = s
        st = self.stats
        st.prompt_tokens += P
        st.cached_tokens += s

    def _load(self, req: Request, blocks: list[Block]) -> None:
        """Copy the blocks' rows and the last one's snapshot into the request's slot."""
        with_mtp = bool(req.spec_k)
        self.slots.load(req.slot, blocks, with_mtp)
        if req.params.return_routed_experts:
            req.routed = [(0, torch.cat([blk.routing for blk in blocks]))]
        if with_mtp:
            req.mtp_cells = len(blocks) * self.B - 1  # the last cell waits for the next token: recomputed
            req.resume_residual = blocks[-1].residual

    def limit(self, req: Request, budget: int) -> int:
        """`budget` cut so that a prefill chunk ends at the request's next snapshot point."""
        plan = self.plans.get(req)
        if plan is None or req.suspect:
            return budget
        while plan.points and plan.points[0] <= req.num_cached:  # behind it (taken, or passed by a rollback)
            plan.points.pop(0)
        return min(budget, plan.points[0] - req.num_cached) if plan.points else budget

    # ---- after a step --------------------------------------------------------------------------------
    @torch.no_grad()
    def after_forward(self, plan: list[tuple[Request, int]], spec=None) -> None:
        """Right after a successful forward (before sampling may end a request and wipe its slot): take the
        snapshots due at the entries' new lengths. `spec`: the step's `SpecForward` (residual rows), or None."""
        for i, (req, _) in enumerate(plan):
            p = self.plans.get(req)
            if p is None or req.finished or req.suspect or not p.points:
                continue
            e = req.num_cached
            while p.points and p.points[0] < e:  # passed without stopping (cannot happen: chunks end there)
                p.points.pop(0)
            if not p.points or p.points[0] != e:
                continue
            p.points.pop(0)  # (no drafts rode here: a chunk cut at a point by `limit` leaves them out)
            rows = self.slots.snapshot(req.slot)
            residual = None
            if spec is not None and req.spec_k:
                residual = spec.residual[spec.cu[i] + (e - 1 - spec.cached[i])].clone()
            p.pending[e] = (rows, residual)

    @torch.no_grad()
    def collect(self, req: Request) -> None:
        """Insert the request's prefilled full prompt blocks not yet cached (their rows from its slot), attach its
        pending snapshots, then evict past the budget. Called after each step and before its slot is wiped."""
        p = self.plans.get(req)
        if p is None or req.suspect or req.slot is None:
            return
        B, store = self.B, self.store
        done = min(req.num_cached, len(req.prompt_ids)) // B
        mtp = bool(req.spec_k)
        routing = req.routed_experts() if req.params.return_routed_experts and len(p.path) < done else None
        held = len(p.path)
        while len(p.path) < done:
            i = len(p.path)
            blk = store.blocks.get(p.keys[i])
            has_mtp = mtp and req.mtp_cells >= (i + 1) * B
            if blk is None:
                parent = p.path[-1] if p.path else None
                blk = store.insert(p.keys[i], parent, i, self.slots.rows(req.slot, i, has_mtp), has_mtp)
            elif has_mtp and not blk.mtp:
                store.set_mtp_rows(blk, self.slots.mtp_rows(req.slot, i))
            if routing is not None and blk.routing is None and routing.shape[0] >= (i + 1) * B:
                store.set_routing(blk, routing[i * B : (i + 1) * B].clone())
            p.path.append(blk)
        store.hold(p.path[held:])
        for e in [e for e in p.pending if e // B <= len(p.path)]:
            rows, residual = p.pending.pop(e)
            blk = p.path[e // B - 1]
            if blk.snapshot is None or (residual is not None and blk.residual is None):
                store.set_snapshot(blk, rows, residual)
        store.evict()

    # ---- lifetime ------------------------------------------------------------------------------------
    def release(self, req: Request, keep: bool = True) -> None:
        """The request ends or is reset: insert what it prefilled (`keep`: its slot's rows are sound), then drop
        its references."""
        p = self.plans.get(req)
        if p is None:
            return
        if keep:
            self.collect(req)
        del self.plans[req]
        self.store.release(p.path)


def prefix_cache_line(pc: PrefixCache) -> str:
    """The server log's periodic line (since start)."""
    s = pc.stats
    mib = f"{pc.nbytes / 2**20:.1f}/{pc.budget / 2**20:.0f} MiB"
    return (f"prefix cache: {s.cached_tokens}/{s.prompt_tokens} prompt tokens reused ({s.hit_rate:.1%}), "
            f"{len(pc.blocks)} blocks, {mib}, {s.evicted} evicted")  # fmt: skip


def prometheus_lines(pc: PrefixCache | None) -> list[str]:
    """/metrics lines of the prefix cache (none when it is off)."""
    if pc is None:
        return []
    s = pc.stats
    return [
        "# HELP flashnext_prefix_cache_prompt_tokens_total prompt tokens of admitted requests (looked up)",
        "# TYPE flashnext_prefix_cache_prompt_tokens_total counter",
        f"flashnext_prefix_cache_prompt_tokens_total {s.prompt_tokens}",
        "# HELP flashnext_prefix_cache_cached_tokens_total prompt tokens resumed from the cache instead of prefilled",
        "# TYPE flashnext_prefix_cache_cached_tokens_total counter",
        f"flashnext_prefix_cache_cached_tokens_total {s.cached_tokens}",
        "# HELP flashnext_prefix_cache_hit_rate cached / prompt tokens since start",
        "# TYPE flashnext_prefix_cache_hit_rate gauge",
        f"flashnext_prefix_cache_hit_rate {s.hit_rate:.6f}",
        "# TYPE flashnext_prefix_cache_bytes gauge",
        f"flashnext_prefix_cache_bytes {pc.nbytes}",
        "# TYPE flashnext_prefix_cache_budget_bytes gauge",
        f"flashnext_prefix_cache_budget_bytes {pc.budget}",
        "# TYPE flashnext_prefix_cache_blocks gauge",
        f"flashnext_prefix_cache_blocks {len(pc.blocks)}",
        "# HELP flashnext_prefix_cache_evictions_total blocks evicted (budget, or stale weights)",
        "# TYPE flashnext_prefix_cache_evictions_total counter",
        f"flashnext_prefix_cache_evictions_total {s.evicted}",
    ]
