"""The vision tower: patches -> ViT blocks (attention within each frame) -> merged tokens of the text width.

Legend: N patches (all images, all frames), P = in_channels * temporal_patch_size * patch_size**2 (one flattened
patch), C vision width, H heads, Dh head dim, m spatial_merge_size, n images, side = sqrt(position table rows).

Patch order. An image with grid `(t, h, w)` (in patches) contributes `t * h * w` rows of `pixel_values`, frame by
frame, each frame in *merge-block order*: the `m x m` patches that the merger folds into one text token are
consecutive (block row, block col, row in block, col in block). Position embeddings and rotary positions follow
the same order; the processor (`flashnext.vision_inputs`) emits patches that way.

Names and shapes of parameters equal the reference's in-memory `model.visual.*`, so loading is a name map. The
patch embedding keeps the reference's Conv3d weight shape `[C, in_channels, temporal, patch, patch]`; because the
stride equals the kernel, the convolution is a linear map of each flattened patch, computed as `F.linear` with
the weight viewed `[C, P]` (a free view).

Attention runs within each *frame* (the reference's cu_seqlens are per frame: `t` segments of `h * w` patches per
image): one batched SDPA when all frames have the same size, else SDPA frame by frame (exact; a varlen kernel is
the fast path still to add for many differently sized images). There is no deepstack in this reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.config import VisionConfig
from flashnext.errors import InputError
from flashnext.model.rope import apply_rotary


def grid_list(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    """Host `(t, h, w)` per image from `image_grid_thw: int [n, 3]` (one host read)."""
    if grid_thw.dim() != 2 or grid_thw.shape[-1] != 3:
        raise InputError(f"image_grid_thw must be [n_images, 3], got shape {tuple(grid_thw.shape)}")
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def merge_block_coords(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of an `h x w` frame, in merge-block order. Both int64 [h * w]."""
    rows = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m)
    cols = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m)
    return rows.reshape(-1), cols.reshape(-1)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear align-corners taps of a `size`-long axis into a `side`-long table: (taps [k, 2], weights [k, 2]).

    Position i samples the table at `i * (side - 1) / (size - 1)` (the end points map to the table's ends, so any
    `size` works, multiple of `side` or not); its two neighbours get the hat-kernel weights.
    """
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    lo = torch.floor(src)
    frac = src - lo
    taps = torch.stack([lo, lo + 1], dim=-1).long().clamp(0, side - 1)
    weights = torch.stack([1 - frac, 1 - (1 - frac)], dim=-1).clamp(min=0)  # 1 - |distance| per tap, as a hat
    return taps, weights


def position_taps(grid: list[tuple[int, int, int]], side: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the learned `side x side` position table and their bilinear weights for every patch.

    Returns:
        taps: int64 [N, 4] flat table rows (row-major `side x side`), weights: fp32 [N, 4]; tap order
        (top-left, top-right, bottom-left, bottom-right).
    """
    all_taps, all_weights = [], []
    for t, h, w in grid:
        rows, cols = merge_block_coords(h, w, m)
        h_taps, h_w = _axis_taps(rows, h, side)
        w_taps, w_w = _axis_taps(cols, w, side)
        taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        all_taps.append(taps.repeat(t, 1))
        all_weights.append(weights.repeat(t, 1))
    return torch.cat(all_taps), torch.cat(all_weights)


def rotary_coords(grid: list[tuple[int, int, int]], m: int) -> torch.Tensor:
    """(row, col) of every patch, int64 [N, 2], repeated over each image's frames."""
    out = []
    for t, h, w in grid:
        rows, cols = merge_block_coords(h, w, m)
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


class VisionRotary(nn.Module):
    """Axial 2-D rotary: the first half of each head's frequencies rotate by the row, the second by the column.

    cos/sin are fp32 and the rotation runs in fp32 (then casts back), as the reference does.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    @torch.no_grad()
    def forward(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """coords: int [N, 2] (row, col) -> (cos, sin), each fp32 [N, Dh]."""
        half = self.head_dim // 2
        inv = 1.0 / (self.theta ** (torch.arange(0, half, 2, dtype=torch.float, device=coords.device) / half))
        freqs = coords[..., None].float() * inv  # [N, 2, Dh/4]
        emb = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([emb, emb], dim=-1)
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each segment (frame) of the patch stream."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.h, self.d = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x: [N, C]; cos/sin fp32 [N, Dh]; lengths: host segment lengths summing to N -> [N, C]."""
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.h, self.d).unbind(1)
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        if len(set(lengths)) == 1:  # equal segments: one batched call
            n = len(lengths)
            q, k, v = (t.view(n, lengths[0], self.h, self.d).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(N, -1)
        else:
            outs = []
            for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
                o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
                outs.append(o.transpose(0, 1).reshape(o.shape[1], -1))
            o = torch.cat(outs)
        return self.proj(o)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """Pre-norm transformer block (LayerNorm, eps 1e-6)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Linear projection of each flattened patch; `proj.weight` keeps the reference's Conv3d shape."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Module()
        shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj.weight = nn.Parameter(torch.empty(shape))
        self.proj.bias = nn.Parameter(torch.empty(cfg.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [N, P] -> [N, C]."""
        w = self.proj.weight
        return F.linear(pixel_values.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each `m x m` block of patches (consecutive rows) -> one token of the text width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, C] -> [N / m^2, out_hidden_size]."""
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged))))


class VisionModel(nn.Module):
    """Patch embedding + interpolated learned positions + axial rotary blocks + merger (`model.visual`)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.side = int(cfg.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.rotary_pos_emb = VisionRotary(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def check_inputs(self, pixel_values: torch.Tensor, grid: list[tuple[int, int, int]]) -> None:
        """Raise InputError unless `pixel_values` is `[sum t*h*w, P]` and every h, w is a multiple of m."""
        cfg, m = self.config, self.config.spatial_merge_size
        for i, (t, h, w) in enumerate(grid):
            if min(t, h, w) <= 0 or h % m or w % m:
                raise InputError(
                    f"image_grid_thw[{i}]=({t}, {h}, {w}): t, h, w must be positive and h, w multiples of "
                    f"spatial_merge_size={m}"
                )
        want = (sum(t * h * w for t, h, w in grid), cfg.patch_dim)
        if tuple(pixel_values.shape) != want:
            raise InputError(
                f"pixel_values has shape {tuple(pixel_values.shape)} but image_grid_thw needs {want} "
                f"(sum of t*h*w patches x in_channels*temporal_patch_size*patch_size^2)"
            )

    def position_embedding(self, grid: list[tuple[int, int, int]], device) -> torch.Tensor:
        """The learned `side x side` table bilinearly resampled to every patch (differentiable): [N, C]."""
        taps, weights = position_taps(grid, self.side, self.config.spatial_merge_size)
        return (self.pos_embed(taps.to(device)) * weights.to(device)[:, :, None]).sum(1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values: [N, P], grid_thw: int [n, 3] -> merged image tokens [N / m^2, out_hidden_size]."""
        grid = grid_list(grid_thw)
        self.check_inputs(pixel_values, grid)
        x = self.patch_embed(pixel_values)
        x = x + self.position_embedding(grid, x.device).to(x.dtype)
        cos, sin = self.rotary_pos_emb(rotary_coords(grid, self.config.spatial_merge_size).to(x.device))
        lengths = [h * w for t, h, w in grid for _ in range(t)]  # attention never crosses a frame
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    @torch.no_grad()
    def init_weights(self, std: float, gen: torch.Generator | None = None) -> None:
        """normal(0, std) matrices and tables, zero biases, LayerNorms at identity (as the reference)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".norm" in name or name.startswith("norm"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
