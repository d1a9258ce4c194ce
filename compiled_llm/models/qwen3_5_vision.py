"""Qwen3.5 vision side: the vision tower reused from transformers, and the M-RoPE positions of prompts
that hold images or videos.

Used by models/qwen3_5_mm.py (the engine's media path, docs/multimodal.md):
- `VisionTower(vision_config)` then `tower(pixel_values, grid_thw)`: one embedding per merged patch
  (spatial_merge_size^2 patches), in the order of the placeholder tokens;
- `merge_embeddings(...)` puts them at the image/video placeholder tokens of the text embeddings (the engine
  merges per prefill chunk instead; this one serves model-level checks);
- `mrope_positions(...)` gives the [3, tokens] positions of the prompt and the delta that later text tokens
  add to their index (position = index + delta on all three components).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

TEXT, IMAGE, VIDEO = 0, 1, 2


def mrope_positions(token_types: list[int], image_grids: list[tuple[int, int, int]],
                    video_grids: list[tuple[int, int, int]], spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """token_types: per prompt token TEXT, IMAGE or VIDEO; grids: (t, h, w) patch grid of each image / video,
    in prompt order. Each run of image tokens takes the next image; each run of video tokens takes the next
    frame (a video's frames are separated by timestamp text). Text continues from the largest position so far.
    Returns positions [3, tokens] (long) and the delta for the tokens after the prompt."""
    frames = [(1, h, w) for t, h, w in video_grids for _ in range(t)]
    grids = {IMAGE: iter(image_grids), VIDEO: iter(frames)}
    out, pos, i, n = [], 0, 0, len(token_types)
    while i < n:
        kind = token_types[i]
        j = i
        while j < n and token_types[j] == kind:
            j += 1
        if kind == TEXT:
            out.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
        else:
            t, h, w = next(grids[kind])
            h, w = h // spatial_merge_size, w // spatial_merge_size
            if t * h * w != j - i:
                raise ValueError(f"{j - i} placeholder tokens for a grid of {t}x{h}x{w} merged patches")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            out.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(h, w)
        i = j
    positions = torch.cat(out, dim=1) if out else torch.zeros(3, 0, dtype=torch.long)
    return positions, pos - n


def merge_embeddings(embeds: torch.Tensor, token_types: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """embeds [tokens, hidden] with the vision features written at the non-text tokens, in order."""
    mask = token_types != TEXT
    if int(mask.sum()) != features.shape[0]:
        raise ValueError(f"{int(mask.sum())} placeholder tokens but {features.shape[0]} vision embeddings")
    out = embeds.clone()
    out[mask] = features.to(embeds.dtype)
    return out


class VisionTower(nn.Module):
    """transformers' Qwen3.5 vision model (patch embed, ViT blocks, 2x2 merger), built from the checkpoint's
    vision_config; its weights are the checkpoint's `model.visual.*` tensors."""

    PREFIXES = ("model.visual.", "visual.")

    def __init__(self, vision_config: dict):
        super().__init__()
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        cfg = {k: v for k, v in vision_config.items() if k not in ("model_type", "architectures")}
        self.model = Qwen3_5VisionModel(Qwen3_5VisionConfig(**cfg))
        self.spatial_merge_size = self.model.spatial_merge_size

    def hf_to_ours(self, name: str) -> str | None:
        for prefix in self.PREFIXES:
            if name.startswith(prefix):
                return "model." + name[len(prefix):]
        return None

    def load(self, folder: Path, progress: bool = False) -> "VisionTower":
        from compiled_llm.models.loader import load_weights

        load_weights(self, Path(folder), self.hf_to_ours, progress)
        return self

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values: [patches, channels * temporal_patch * patch * patch] as the processor flattens them;
        grid_thw: [items, 3]. Returns [merged patches, text hidden size]."""
        dtype = self.model.patch_embed.proj.weight.dtype
        return self.model(pixel_values.to(dtype), grid_thw=grid_thw).pooler_output
