"""Qwen3.5 / Qwen3.6 with their vision tower (Qwen3_5ForConditionalGeneration and the MoE variant).

The text backbone is ours (models/qwen3_5.py); the vision tower is transformers' own
(models/qwen3_5_vision.py VisionTower), loaded from the checkpoint's `model.visual.*` tensors. Image and
video embeddings replace the text embeddings at the placeholder tokens (`<|image_pad|>`, `<|video_pad|>`),
and a prompt with media gets [3, tokens] M-RoPE positions (`prompt_positions`). Vision tokens attend
causally, like text (transformers builds one causal mask for every full-attention layer), so there are no
bidirectional spans. Text-only prompts run exactly as on Qwen3_5ForCausalLM.
"""

from __future__ import annotations

import torch

from compiled_llm.models.interfaces import SupportsMultiModal
from compiled_llm.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from compiled_llm.models.qwen3_5_config import Qwen3_5TextConfig
from compiled_llm.models.qwen3_5_vision import IMAGE, TEXT, VIDEO, VisionTower, mrope_positions

# modality -> (pixel tensor, grid tensor) in the processor's output
MEDIA_KEYS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


class _VisionMixin(SupportsMultiModal):
    bidirectional_vision = False  # causal vision tokens: the scheduler may split an image across chunks

    def _init_vision(self, cfg: Qwen3_5TextConfig) -> None:
        hf = getattr(cfg, "hf_config", None) or {}
        self.image_token_id = hf.get("image_token_id")
        self.video_token_id = hf.get("video_token_id")
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        vision = hf.get("vision_config")
        self.visual = VisionTower(vision).eval() if vision else None

    @classmethod
    def config_from_hf(cls, hf: dict) -> Qwen3_5TextConfig:
        cfg = super().config_from_hf(hf)
        cfg.hf_config = hf
        return cfg

    # ---- media ---------------------------------------------------------------------------
    def supported_modalities(self) -> set[str]:
        if self.visual is None:
            return set()
        return set(self.placeholder_token_ids())

    def placeholder_token_ids(self) -> dict[str, int]:
        ids = {"image": self.image_token_id, "video": self.video_token_id}
        return {m: t for m, t in ids.items() if t is not None}

    def embed_media(self, modality: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Vision embeddings of one image or video, [merged patches, hidden], in placeholder order."""
        if modality not in MEDIA_KEYS:
            raise ValueError(f"unknown modality {modality!r}")
        pixels, grid = (tensors[k] for k in MEDIA_KEYS[modality])
        dev = next(self.visual.parameters()).device
        return self.visual(pixels.to(dev), grid.to(dev))

    def embed_with_media(self, input_ids: torch.Tensor, rows: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Text embeddings of input_ids with `features` written at `rows`."""
        x = self.model.embed_tokens(input_ids)
        if rows.numel():
            x = x.index_copy(0, rows, features.to(x.dtype))
        return x

    def prompt_positions(self, ids: list[int], items) -> tuple[torch.Tensor, int]:
        """[3, prompt tokens] M-RoPE positions of a prompt with media, and the delta that later tokens add
        to their index. items: the prompt's MediaItems (their grids, in prompt order)."""
        kinds = {self.image_token_id: IMAGE, self.video_token_id: VIDEO}
        types = [kinds.get(t, TEXT) for t in ids]
        grids = {m: [tuple(int(x) for x in row) for it in items if it.modality == m
                     for row in it.tensors[MEDIA_KEYS[m][1]].reshape(-1, 3).tolist()] for m in MEDIA_KEYS}
        return mrope_positions(types, grids["image"], grids["video"], self.visual.spatial_merge_size)

    # ---- weights -------------------------------------------------------------------------
    def hf_to_ours(self, name: str):
        for prefix in VisionTower.PREFIXES:
            if name.startswith(prefix):
                return None if self.visual is None else "visual.model." + name[len(prefix):]
        return super().hf_to_ours(name)


class Qwen3_5ForConditionalGeneration(_VisionMixin, Qwen3_5ForCausalLM):
    """Qwen3.5 dense text backbone (ours) plus transformers' vision tower."""

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__(cfg)
        self._init_vision(cfg)


class Qwen3_5MoeForConditionalGeneration(_VisionMixin, Qwen3_5MoeForCausalLM):
    """Qwen3.5 MoE text backbone (ours) plus transformers' vision tower."""

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__(cfg)
        self._init_vision(cfg)


__all__ = ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"]
