"""The composite vision-language model (`FlashNextForConditionalGeneration`), on flat streams or padded batches.

Legend: B/S padded batch/sequence, T flat tokens, N sequences, D text hidden, V vocab, n images, m spatial merge.

The vision tower turns each image into `t * (h / m) * (w / m)` features; they replace the token embeddings at the
image placeholders (`image_token_id`), in stream order. PLE still hashes the raw placeholder ids. Positions are
3-D MRoPE (`get_rope_index`): text advances all three axes together, an image spans its merged grid on the h/w
axes from the current position, and the text after it resumes at `current + max(h, w) / m`.

State-dict names equal the reference's in-memory `Qwen4ExpForConditionalGeneration` (`model.visual.*`,
`model.language_model.*`, `lm_head.*`); with `language_model_only` there is no `model.visual`.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from flashnext.batch import Segments, flatten_inputs, integer_tensor, make_segments
from flashnext.config import ModelConfig, TextConfig
from flashnext.errors import ConfigError, InputError
from flashnext.model.heads import CausalLMOutput, causal_lm_outputs
from flashnext.model.mtp import MultiTokenPredictor
from flashnext.model.text import FlashNextForCausalLM, FlashNextTextModel
from flashnext.model.vision import VisionModel, grid_list

TEXT_TYPE, IMAGE_TYPE = 0, 1


def get_rope_index(
    input_ids: torch.Tensor,
    cu_seqlens: list[int],
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    spatial_merge_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D MRoPE positions of a flat stream, per sequence exactly as the reference's `get_rope_index`.

    Each maximal run of equal `mm_token_type_ids` is one span: a text run of length L takes positions
    `p .. p+L-1` on all three axes; an image run takes the next grid `(t, h, w)` and positions
    `(p + t_i, p + h_i, p + w_i)` over its merged `t x h/m x w/m` grid (row-major), then `p += max(h, w) / m`.

    Args:
        input_ids: int [T] (only its device and length are used).
        cu_seqlens: host [N+1] sequence boundaries; positions restart at 0 in every sequence.
        mm_token_type_ids: int [T], 0 text, 1 image.
        image_grid_thw: int [n, 3], consumed in stream order.
        spatial_merge_size: m.

    Returns:
        position_ids int64 [3, T], and `deltas` int64 [N]: `max position + 1 - length` per sequence (a decode step
        continuing sequence i uses text position `length_i + deltas[i]` on all three axes).
    """
    types = mm_token_type_ids.tolist()
    grids = iter(grid_list(image_grid_thw) if image_grid_thw is not None else [])
    m = spatial_merge_size
    parts: list[torch.Tensor] = []
    deltas = []
    for start, stop in itertools.pairwise(cu_seqlens):
        pos, seq_parts, offset = 0, [], start
        for kind, run in itertools.groupby(types[start:stop]):
            n = len(list(run))
            if kind == TEXT_TYPE:
                seq_parts.append(torch.arange(pos, pos + n).expand(3, n))
                pos += n
            elif kind == IMAGE_TYPE:
                t, h, w = _next_grid(grids, offset)
                if t * (h // m) * (w // m) != n:
                    raise InputError(
                        f"image span at flat position {offset} has {n} placeholder tokens but its grid "
                        f"({t}, {h}, {w}) gives {t * (h // m) * (w // m)} features (spatial_merge_size={m})"
                    )
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h // m), torch.arange(w // m), indexing="ij")
                seq_parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
                pos += max(h, w) // m
            else:
                raise InputError(f"mm_token_type_ids[{offset}]={kind}: only 0 (text) and 1 (image) are supported")
            offset += n
        seq = torch.cat(seq_parts, dim=1) if seq_parts else torch.zeros(3, 0, dtype=torch.long)
        parts.append(seq)
        deltas.append((int(seq.max()) + 1 if seq.numel() else 0) - (stop - start))
    if next(grids, None) is not None:
        raise InputError(f"image_grid_thw has {image_grid_thw.shape[0]} images but the stream has fewer image spans")
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return positions.to(input_ids.device), torch.tensor(deltas, dtype=torch.long, device=input_ids.device)


def _next_grid(grids, offset: int) -> tuple[int, int, int]:
    grid = next(grids, None)
    if grid is None:
        raise InputError(f"image span at flat position {offset} has no entry left in image_grid_thw")
    return grid


class FlashNextMultimodalModel(nn.Module):
    """The reference's `Qwen4ExpModel`: `visual` (absent with `language_model_only`) and `language_model`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        vision = cfg.vision_config
        if vision is not None and vision.out_hidden_size != cfg.text.hidden_size:
            raise ConfigError(
                f"vision_config.out_hidden_size={vision.out_hidden_size} != text hidden_size={cfg.text.hidden_size}"
            )
        self.visual = VisionModel(vision) if vision is not None else None
        self.language_model = FlashNextTextModel(cfg.text)


class FlashNextForConditionalGeneration(nn.Module):
    """Qwen3.8-Flash-Next with its vision tower. Called like `FlashNextForCausalLM`, plus image inputs.

    Same interface as `FlashNextForCausalLM` (see there): `decoder`, and the optional parts `visual` (None with
    `language_model_only`) and `mtp`, the MTP draft head (`mtp.*`, when the text config declares an MTP layer; the
    same head as the text model's, trained with `return_mtp` and served by `draft_step`).
    """

    # The serving steps are the text model's: image features come in `forward_step`'s `inputs_embeds` (`embed`)
    # and MRoPE positions in `step` (`make_step(..., mrope=...)`), so the tower never runs in a serving step.
    forward_step = FlashNextForCausalLM.forward_step
    draft_step = FlashNextForCausalLM.draft_step
    mtp_head_weight = FlashNextForCausalLM.mtp_head_weight

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.composite:
            raise ConfigError("FlashNextForConditionalGeneration needs a composite (model_type 'qwen4_exp') config")
        self.model_config = cfg
        self.config = cfg.text
        self.image_token_id = cfg.image_token_id
        self.model = FlashNextMultimodalModel(cfg)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        # Registered after `lm_head`, as in the text model: the trunk's init draws do not depend on it.
        self.mtp = MultiTokenPredictor(cfg.text) if cfg.text.mtp_layers else None
        self.extra_tensors: dict[str, torch.Tensor] = {}

    @property
    def decoder(self) -> FlashNextTextModel:
        """The text decoder, as `FlashNextForCausalLM.decoder`."""
        return self.model.language_model

    @property
    def visual(self) -> VisionModel | None:
        """The vision tower; None with `language_model_only`."""
        return self.model.visual

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
        logprob_targets: torch.Tensor | None = None,
        return_logits: bool = True,
        return_mtp: bool = False,
    ) -> CausalLMOutput:
        """Padded `[B, S]` ids (+ `attention_mask`), or flat `[T]` ids with `cu_seqlens` (`[N+1]`).

        Args:
            pixel_values: float [sum t*h*w, P], the patches of every image in stream order.
            image_grid_thw: int [n_images, 3], each image's (t, h, w) in patches.
            mm_token_type_ids: same layout as `input_ids`, 0 text / 1 image; derived from the placeholders
                (`input_ids == image_token_id`) when absent.
            position_ids: `[3, B, S]` / `[3, T]` MRoPE positions (or `[B, S]` / `[T]`); computed with
                `get_rope_index` when absent.
            labels, routed_experts, logprob_targets, return_logits, return_mtp: as `FlashNextForCausalLM.forward`
                (the MTP head's cells rotate at the tokens' MRoPE positions).

        Raises:
            InputError: as `FlashNextForCausalLM.forward`, plus image inputs of the wrong shape or dtype or whose
                count does not match the placeholders.
        """
        inputs = flatten_inputs(
            input_ids,
            attention_mask,
            cu_seqlens=cu_seqlens,
            position_ids=position_ids,
            labels=labels,
            mm_token_type_ids=mm_token_type_ids,
            logprob_targets=logprob_targets,
        )
        ids, seg = inputs.ids, inputs.seg
        FlashNextForCausalLM._check_ids(self, ids)
        FlashNextForCausalLM._check_replay(self, routed_experts, ids.shape[0])
        self._check_images(pixel_values, image_grid_thw)
        embeds = self.embed(ids, pixel_values, image_grid_thw, inputs.per_token["mm_token_type_ids"])
        if position_ids is None and image_grid_thw is not None:
            seg = self.mrope_segments(ids, seg, inputs.per_token["mm_token_type_ids"], image_grid_thw)
        return causal_lm_outputs(self, inputs, seg, routed_experts, embeds, return_logits, return_mtp)

    def _check_images(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None) -> None:
        """Host-side shape/dtype checks of the image inputs (counts against the placeholders: `embed`)."""
        if image_grid_thw is not None:
            integer_tensor("image_grid_thw", image_grid_thw)
            if image_grid_thw.dim() != 2 or image_grid_thw.shape[1] != 3:
                raise InputError(f"image_grid_thw must be [n_images, 3] (t, h, w), got {tuple(image_grid_thw.shape)}")
        if pixel_values is None or self.visual is None:  # no tower: `get_image_features` says so
            return
        patch_dim = self.visual.config.patch_dim
        if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
            got = pixel_values.dtype if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
            raise InputError(f"pixel_values must be a floating-point tensor, got {got}")
        if pixel_values.dim() != 2 or pixel_values.shape[1] != patch_dim:
            raise InputError(
                f"pixel_values must be [n_patches, {patch_dim}] (one flattened patch per row), "
                f"got {tuple(pixel_values.shape)}"
            )

    def state_spec(self, max_len: int) -> list[dict]:
        """Per decoder layer, the per-sequence serving state (the vision tower keeps none), then the MTP head's."""
        return FlashNextForCausalLM.state_spec(self, max_len)

    def mrope_segments(
        self, ids: torch.Tensor, seg: Segments, mm_token_type_ids: torch.Tensor | None, grid_thw: torch.Tensor
    ) -> Segments:
        """`seg` with its positions replaced by the 3-D MRoPE positions of `get_rope_index`."""
        if mm_token_type_ids is None:
            mm_token_type_ids = (ids == self.image_token_id).long()
        if self.visual is None:
            raise InputError("image_grid_thw given but this model has no vision tower (language_model_only)")
        positions, _ = get_rope_index(
            ids, seg.cu_host, mm_token_type_ids, grid_thw, self.visual.config.spatial_merge_size
        )
        return make_segments(seg.cu_seqlens, ids.shape[0], positions, device=ids.device)

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Vision tower output for every image, concatenated in order: [sum t*h*w / m^2, D]."""
        if self.visual is None:
            raise InputError("pixel_values given but this model has no vision tower (language_model_only)")
        return self.visual(pixel_values, image_grid_thw)

    def embed(
        self,
        ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        mm_token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings [T, D] with image features scattered into the placeholder positions.

        `mm_token_type_ids` (int [T], 1 = image), when given, says which tokens are placeholders: a placeholder id
        the model generated after the prompt is a text token (as in a cached decode), so an RL rollout that holds
        one trains on what was served. Default: every `image_token_id`.
        """
        embeds = self.model.language_model.embed_tokens(ids)
        if pixel_values is None:
            return embeds
        if image_grid_thw is None:
            raise InputError("pixel_values given without image_grid_thw")
        feats = self.get_image_features(pixel_values, image_grid_thw).to(embeds.dtype)
        mask = ids == self.image_token_id if mm_token_type_ids is None else mm_token_type_ids.bool()
        n_tokens = int(mask.sum())
        if n_tokens != feats.shape[0]:
            raise InputError(
                f"image features and image tokens do not match: {n_tokens} image_token_id={self.image_token_id} "
                f"placeholders in input_ids, {feats.shape[0]} image features from image_grid_thw"
            )
        return embeds.masked_scatter(mask[:, None], feats)

    # ---- weights ---------------------------------------------------------------------------------------
    def freeze_vision(self, frozen: bool = True) -> None:
        """Stop (or restart) training the vision tower: no gradients, so the optimizer holds no state for it."""
        if self.visual is not None:
            self.visual.requires_grad_(not frozen)

    def reset_buffers(self) -> None:
        """Recompute derived (non-persistent) buffers, e.g. after `to_empty` from the meta device."""
        FlashNextForCausalLM.reset_buffers(self)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random init as the reference does: the text model's rule, then the vision tower's."""
        FlashNextForCausalLM.init_weights(self, seed)
        if self.visual is not None:
            gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed + 1)
            self.visual.init_weights(self.config.initializer_range, gen)


def on_meta(config: TextConfig | ModelConfig, dtype: torch.dtype) -> nn.Module:
    """The model of `config` on the meta device (no memory), cast to `dtype` there."""
    multimodal = isinstance(config, ModelConfig) and config.vision_config is not None
    with torch.device("meta"):
        if multimodal:
            model = FlashNextForConditionalGeneration(config)
        else:
            model = FlashNextForCausalLM(config.text if isinstance(config, ModelConfig) else config)
    return model.to(dtype=dtype)
