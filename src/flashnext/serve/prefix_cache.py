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
from flashnext.serve.request import Request

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_BUDGET_MB", "PrefixCache", "PrefixStats", "prefix_cache_line",
           "prometheus_lines"]  # fmt: skip

DEFAULT_BLOCK_SIZE = 256  # tokens per block: 4 GDN chunks; a GDN snapshot costs ~2-4k tokens of QSA K/V (PREFIX.md)
DEFAULT_BUDGET_MB = 1024.0


@dataclass(eq=False)
class Block:
    """One cached block of B tokens (positions `index*B .. (index+1)*B - 1`) of a path; see the module doc."""

    key: bytes
    root: bytes
    parent: Block | None
    index: int
    rows: list[torch.Tensor]  # per positional buffer (trunk's, then the MTP head's), this block's rows
    mtp: bool  # whether the MTP head's rows hold its cells
    snapshot: list[torch.Tensor] | None = None  # per window/recurrent buffer, the slot's row after the block
    residual: torch.Tensor | None = None  # [hc*D] trunk residual of the block's last token (MTP resume)
    routing: torch.Tensor | None = None  # uint16 [B, L, k] its tokens' routed experts (requests that record them)
    children: int = 0
    refs: int = 0
    last_used: int = 0
    nbytes: int = 0


@dataclass(eq=False)
class _Plan:
    """A request's walk along the cache: its blocks' keys, the path it holds, where it snapshots."""

    keys: list[bytes]
    path: list[Block] = field(default_factory=list)  # blocks 0 .. len(path)-1 of its prompt, referenced
    points: list[int] = field(default_factory=list)  # snapshot positions still ahead, ascending
    pending: dict[int, tuple[list[torch.Tensor], torch.Tensor | None]] = field(default_factory=dict)


@dataclass
class PrefixStats:
    """Counters for /metrics and the server log: prompt tokens looked up at admission, cached tokens reused,
    blocks inserted and evicted, snapshots taken."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    inserted: int = 0
    evicted: int = 0
    snapshots: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _check_block_size(block_size: int, ratio: int) -> None:
    if block_size < 1 or block_size % CHUNK or (ratio and block_size % ratio):
        raise ConfigError(
            f"prefix cache block size {block_size} must be a positive multiple of the GDN chunk ({CHUNK}) and of "
            f"the QSA block (indexer_compress_ratio={ratio})"
        )


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
        n_mtp = 0 if mtp is None else len(mtp.layers)
        self.image_token_id = getattr(model, "image_token_id", None)  # composite models
        # Positional buffers (buffer, tokens per row: 1, or c for the pooled index keys, of the MTP head): block i's
        # rows are a slice; the window and recurrent buffers (`states`) are what a snapshot copies.
        kinds = {id(b): k for b, k in cache.kinds()}
        found = []  # (buffer, is positional, of the MTP head), in layer order
        for li, layer in enumerate(cache.layers):
            for part in layer.values():
                for buf in vars(part).values():
                    found.append((buf, kinds[id(buf)] == POSITIONAL, li >= len(cache.layers) - n_mtp))
        longest = max((b.shape[1] for b, pos, _ in found if pos), default=1)
        self.positional = [(b, longest // b.shape[1], m) for b, pos, m in found if pos]
        self.states = [b for b, pos, _ in found if not pos]
        self.blocks: dict[bytes, Block] = {}
        self.plans: dict[Request, _Plan] = {}
        self.stats = PrefixStats()
        self.nbytes = 0
        self.weight_version, self.generation = 0, 0
        self._root = self._make_root()
        self._clock = 0
        self._stale = False  # whether blocks of older weights may remain

    # ---- keys ----------------------------------------------------------------------------------------
    def _make_root(self) -> bytes:
        return hashlib.blake2b(f"flashnext-prefix/{self.weight_version}/{self.generation}".encode(),
                               digest_size=16).digest()  # fmt: skip

    def set_weights(self, weight_version: int, generation: int) -> None:
        """The weights' identity; a change makes every block stale (dropped once unreferenced)."""
        if (weight_version, generation) != (self.weight_version, self.generation):
            self.weight_version, self.generation = weight_version, generation
            self._root = self._make_root()
            self._stale = bool(self.blocks)
            self._evict()

    def keys(self, req: Request) -> list[bytes]:
        """One key per full block of the prompt (see the module doc)."""
        ids, B = req.prompt_ids, self.B
        first_image = None
        if req.images is not None:  # the images' content from the block of the first image token on
            first_image = next((i for i, t in enumerate(ids) if t == self.image_token_id), 0)
            pixels, grid = req.images
            h = hashlib.blake2b(digest_size=16)
            h.update(pixels.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            h.update(grid.detach().cpu().to(torch.int64).numpy().tobytes())
            images = h.digest()
        out, key = [], self._root
        for i in range(len(ids) // B):
            h = hashlib.blake2b(key, digest_size=16)
            h.update(torch.tensor(ids[i * B : (i + 1) * B], dtype=torch.int64).numpy().tobytes())
            if first_image is not None and first_image < (i + 1) * B:
                h.update(images)
            key = h.digest()
            out.append(key)
        return out

    # ---- admission -----------------------------------------------------------------------------------
    @torch.no_grad()
    def admit(self, req: Request) -> None:
        """Resume a newly admitted request (its slot allocated, empty) from the deepest usable cached block and
        plan its snapshots; sets `num_cached` (and the MTP resume state of a speculating request)."""
        B, P = self.B, len(req.prompt_ids)
        plan = _Plan(self.keys(req))
        self.plans[req] = plan
        matched = []
        for key in plan.keys:
            blk = self.blocks.get(key)
            if blk is None:
                break
            matched.append(blk)
        d = 0
        routed = req.params.return_routed_experts
        for i, blk in enumerate(matched):
            if (req.spec_k and not blk.mtp) or (routed and blk.routing is None):
                break
            if req.params.prompt_logprobs is not None:  # every prompt position is to be scored: no resume
                break
            if blk.snapshot is not None and (i + 1) * B < P and (not req.spec_k or blk.residual is not None):
                d = i + 1
        self._clock += 1
        for blk in matched:
            blk.refs += 1
            blk.last_used = self._clock
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
        slot, B = req.slot, self.B
        with_mtp = bool(req.spec_k)
        for j, (buf, per, is_mtp) in enumerate(self.positional):
            if is_mtp and not with_mtp:
                continue
            rows = torch.cat([blk.rows[j] for blk in blocks]) if len(blocks) > 1 else blocks[0].rows[j]
            buf[slot, : len(blocks) * B // per].copy_(rows)
        last = blocks[-1]
        for buf, row in zip(self.states, last.snapshot, strict=True):
            buf[slot].copy_(row)
        if req.params.return_routed_experts:
            req.routed = [(0, torch.cat([blk.routing for blk in blocks]))]
        if with_mtp:
            req.mtp_cells = len(blocks) * B - 1  # the last cell waits for the next token: recomputed
            req.resume_residual = last.residual

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
            rows = [buf[req.slot].clone() for buf in self.states]
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
        B = self.B
        done = min(req.num_cached, len(req.prompt_ids)) // B
        mtp = bool(req.spec_k)
        routing = req.routed_experts() if req.params.return_routed_experts and len(p.path) < done else None
        self._clock += 1
        while len(p.path) < done:
            i = len(p.path)
            key = p.keys[i]
            blk = self.blocks.get(key)
            has_mtp = mtp and req.mtp_cells >= (i + 1) * B
            if blk is None:
                parent = p.path[-1] if p.path else None
                blk = Block(key, self._root, parent, i, self._rows(req.slot, i, has_mtp), has_mtp)
                blk.nbytes = sum(r.numel() * r.element_size() for r in blk.rows)
                if parent is not None:
                    parent.children += 1
                self.blocks[key] = blk
                self.nbytes += blk.nbytes
                self.stats.inserted += 1
            elif has_mtp and not blk.mtp:
                self._fill_mtp(blk, req.slot, i)
            if routing is not None and blk.routing is None and routing.shape[0] >= (i + 1) * B:
                blk.routing = routing[i * B : (i + 1) * B].clone()
                blk.nbytes += blk.routing.numel() * blk.routing.element_size()
                self.nbytes += blk.routing.numel() * blk.routing.element_size()
            blk.refs += 1
            blk.last_used = self._clock
            p.path.append(blk)
        for e in [e for e in p.pending if e // B <= len(p.path)]:
            rows, residual = p.pending.pop(e)
            blk = p.path[e // B - 1]
            if blk.snapshot is None or (residual is not None and blk.residual is None):
                self._set_snapshot(blk, rows, residual)
        self._evict()

    def _rows(self, slot: int, i: int, with_mtp: bool) -> list[torch.Tensor]:
        B = self.B
        return [buf[slot, i * B // per : (i + 1) * B // per].clone() if with_mtp or not is_mtp
                else buf.new_empty((0,)) for buf, per, is_mtp in self.positional]  # fmt: skip

    def _fill_mtp(self, blk: Block, slot: int, i: int) -> None:
        B = self.B
        for j, (buf, per, is_mtp) in enumerate(self.positional):
            if is_mtp:
                self.nbytes -= blk.rows[j].numel() * blk.rows[j].element_size()
                blk.rows[j] = buf[slot, i * B // per : (i + 1) * B // per].clone()
                self.nbytes += blk.rows[j].numel() * blk.rows[j].element_size()
        blk.nbytes = self._bytes(blk)
        blk.mtp = True

    def _set_snapshot(self, blk: Block, rows: list[torch.Tensor], residual: torch.Tensor | None) -> None:
        self.nbytes -= self._snapshot_bytes(blk)
        blk.snapshot, blk.residual = rows, residual
        self.nbytes += self._snapshot_bytes(blk)
        blk.nbytes = self._bytes(blk)
        self.stats.snapshots += 1

    def _bytes(self, blk: Block) -> int:
        routing = blk.routing.numel() * blk.routing.element_size() if blk.routing is not None else 0
        return sum(r.numel() * r.element_size() for r in blk.rows) + self._snapshot_bytes(blk) + routing

    @staticmethod
    def _snapshot_bytes(blk: Block) -> int:
        n = sum(r.numel() * r.element_size() for r in blk.snapshot) if blk.snapshot is not None else 0
        return n + (blk.residual.numel() * blk.residual.element_size() if blk.residual is not None else 0)

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
        for blk in p.path:
            blk.refs -= 1
        self._evict()

    def _drop(self, blk: Block) -> None:
        del self.blocks[blk.key]
        self.nbytes -= blk.nbytes
        if blk.parent is not None:
            blk.parent.children -= 1
        self.stats.evicted += 1

    def _evict(self) -> None:
        """Drop unreferenced stale blocks, then unreferenced leaves, least recently used first, past the budget."""
        stale = [b for b in self.blocks.values() if b.root != self._root] if self._stale else []
        self._stale = bool(stale)
        while stale:
            leaves = [b for b in stale if b.refs == 0 and b.children == 0]
            if not leaves:
                break
            for b in leaves:
                self._drop(b)
            stale = [b for b in stale if b.key in self.blocks]
            self._stale = bool(stale)
        if self.nbytes <= self.budget:
            return
        leaves = sorted((b for b in self.blocks.values() if b.refs == 0 and b.children == 0),
                        key=lambda b: b.last_used)  # fmt: skip
        while self.nbytes > self.budget and leaves:
            b = leaves.pop(0)
            self._drop(b)
            parent = b.parent
            if parent is not None and parent.refs == 0 and parent.children == 0 and parent.key in self.blocks:
                pos = next((k for k, o in enumerate(leaves) if o.last_used > parent.last_used), len(leaves))
                leaves.insert(pos, parent)


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
