"""The prefix cache's block store: cached blocks by key, their bytes against a budget, references and eviction.

`serve.prefix_cache` decides what to insert, resume and snapshot (its module doc is the design); this module keeps
the blocks it inserted: each block's tensors and their byte count (positional rows, an optional snapshot and
residual, the routed experts), how many request paths reference it and how many child blocks hang off it, and
evicts past the budget: stale blocks (keys of older weights: another `root`) as soon as they are unreferenced,
then unreferenced leaves, least recently used first (a parent whose last child went becomes a leaf in turn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Block", "BlockStore", "PrefixStats"]


@dataclass(eq=False)
class Block:
    """One cached block of B tokens (positions `index*B .. (index+1)*B - 1`) of a path; see `serve.prefix_cache`."""

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


def _nbytes(t: torch.Tensor | None) -> int:
    return t.numel() * t.element_size() if t is not None else 0


def _snapshot_bytes(blk: Block) -> int:
    return sum(_nbytes(r) for r in blk.snapshot or ()) + _nbytes(blk.residual)


def _block_bytes(blk: Block) -> int:
    return sum(_nbytes(r) for r in blk.rows) + _snapshot_bytes(blk) + _nbytes(blk.routing)


class BlockStore:
    """The cached blocks by key (`blocks`), `nbytes` of them against `budget` bytes; `root` is the current weights'
    key root (a block of another root is stale); `stats` counts insertions, evictions and snapshots."""

    def __init__(self, budget: int, stats: PrefixStats, root: bytes):
        self.blocks: dict[bytes, Block] = {}
        self.budget, self.stats, self.root = budget, stats, root
        self.nbytes = 0
        self._clock = 0
        self._stale = False  # whether blocks of older weights may remain

    def set_root(self, root: bytes) -> None:
        """New weights: every block held now is stale (dropped once unreferenced, never matched again)."""
        self.root = root
        self._stale = bool(self.blocks)
        self.evict()

    def match(self, keys: list[bytes]) -> list[Block]:
        """The cached blocks of the longest prefix of `keys`."""
        matched = []
        for key in keys:
            blk = self.blocks.get(key)
            if blk is None:
                break
            matched.append(blk)
        return matched

    def hold(self, blocks: list[Block]) -> None:
        """Reference `blocks` (a request's path grows by them) and mark them used now."""
        self._clock += 1
        for blk in blocks:
            blk.refs += 1
            blk.last_used = self._clock

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference on each of `blocks` (a request's path ends), then evict past the budget."""
        for blk in blocks:
            blk.refs -= 1
        self.evict()

    def insert(self, key: bytes, parent: Block | None, index: int, rows: list[torch.Tensor], mtp: bool) -> Block:
        """A new block (unreferenced: `hold` it) under the current root."""
        blk = Block(key, self.root, parent, index, rows, mtp)
        blk.nbytes = sum(_nbytes(r) for r in rows)
        if parent is not None:
            parent.children += 1
        self.blocks[key] = blk
        self.nbytes += blk.nbytes
        self.stats.inserted += 1
        return blk

    def set_mtp_rows(self, blk: Block, rows: dict[int, torch.Tensor]) -> None:
        """Give a block cached without them the MTP head's rows (`rows`: by positional buffer index)."""
        for j, row in rows.items():
            self.nbytes += _nbytes(row) - _nbytes(blk.rows[j])
            blk.rows[j] = row
        blk.nbytes = _block_bytes(blk)
        blk.mtp = True

    def set_routing(self, blk: Block, routing: torch.Tensor) -> None:
        """Attach the routed experts of the block's tokens."""
        blk.routing = routing
        blk.nbytes += _nbytes(routing)
        self.nbytes += _nbytes(routing)

    def set_snapshot(self, blk: Block, rows: list[torch.Tensor], residual: torch.Tensor | None) -> None:
        """Attach (or replace) the block's snapshot and MTP residual."""
        self.nbytes -= _snapshot_bytes(blk)
        blk.snapshot, blk.residual = rows, residual
        self.nbytes += _snapshot_bytes(blk)
        blk.nbytes = _block_bytes(blk)
        self.stats.snapshots += 1

    def _drop(self, blk: Block) -> None:
        del self.blocks[blk.key]
        self.nbytes -= blk.nbytes
        if blk.parent is not None:
            blk.parent.children -= 1
        self.stats.evicted += 1

    def evict(self) -> None:
        """Drop unreferenced stale blocks, then unreferenced leaves, least recently used first, past the budget."""
        stale = [b for b in self.blocks.values() if b.root != self.root] if self._stale else []
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
