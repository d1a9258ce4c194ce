"""Gemma 4 with its media towers (Gemma4ForConditionalGeneration checkpoints).

The text backbone is ours (models/gemma4.py); the vision tower, the audio tower and their embedders
(`embed_vision`, `embed_audio`) are transformers' own modules, built from the checkpoint's sub-configs and
loaded from its `model.vision_tower.*`, `model.audio_tower.*`, `model.embed_*.*` tensors.

Media embeddings replace the text embeddings at the placeholder tokens, as transformers' Gemma4Model does:
the placeholder ids become the pad id (for the token embedding and the PLE token-identity table), the
embedding rows at those positions are the tower's soft tokens, and the PLE projection reads the merged
embeddings. With `use_bidirectional_attention == "vision"` the tokens of one image (or one video frame)
attend to each other in both directions on the sliding layers (the runtime passes those spans to the
attention op; docs/multimodal.md).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from compiled_llm.models.gemma4 import Gemma4ForCausalLM
from compiled_llm.models.gemma4_config import Gemma4TextConfig
from compiled_llm.models.interfaces import SupportsMultiModal

_TOWER_PREFIXES = {  # checkpoint prefix -> our attribute
    "model.vision_tower.": "vision_tower.",
    "model.embed_vision.": "embed_vision.",
    "model.audio_tower.": "audio_tower.",
    "model.embed_audio.": "embed_audio.",
}


def _build_tower(sub: dict | None, kind: str):
    """transformers' tower for one sub-config dict (None when the checkpoint has none)."""
    if not sub:
        return None
    from transformers import AutoModel, Gemma4AudioConfig, Gemma4VisionConfig

    cfg_cls = Gemma4VisionConfig if kind == "vision" else Gemma4AudioConfig
    cfg = cfg_cls(**{k: v for k, v in sub.items() if k not in ("model_type", "transformers_version")})
    return AutoModel.from_config(cfg), cfg


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM, SupportsMultiModal):
    """Gemma 4 text backbone (ours) plus transformers' vision/audio towers and embedders."""

    def __init__(self, cfg: Gemma4TextConfig):
        super().__init__(cfg)
        hf = getattr(cfg, "hf_config", None) or {}
        text = hf.get("text_config") or {}
        self.image_token_id = hf.get("image_token_id")
        self.video_token_id = hf.get("video_token_id")
        self.audio_token_id = hf.get("audio_token_id")
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.bidirectional_vision = text.get("use_bidirectional_attention") == "vision"
        self.vision_tower = self.embed_vision = self.audio_tower = self.embed_audio = None
        if self.model.is_first:  # media embeddings are merged before the first layer
            from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

            hf_text = SimpleNamespace(hidden_size=cfg.hidden_size)  # all the embedders read of it
            vision = _build_tower(hf.get("vision_config"), "vision")
            audio = _build_tower(hf.get("audio_config"), "audio")
            if vision:
                self.vision_tower = vision[0].eval()
                self.embed_vision = Gemma4MultimodalEmbedder(vision[1], hf_text)
                self.pooling_kernel_size = vision[1].pooling_kernel_size
            if audio:
                self.audio_tower = audio[0].eval()
                self.embed_audio = Gemma4MultimodalEmbedder(audio[1], hf_text)
        # persistent buffers of the towers are checkpoint tensors too (loader.load_weights reads this)
        self.loaded_buffers = set()
        for attr in ("vision_tower", "audio_tower"):
            tower = getattr(self, attr)
            if tower is not None:
                params = {n for n, _ in tower.named_parameters()}
                self.loaded_buffers |= {f"{attr}.{n}" for n in tower.state_dict() if n not in params}

    @classmethod
    def config_from_hf(cls, hf: dict) -> Gemma4TextConfig:
        cfg = super().config_from_hf(hf)
        cfg.hf_config = hf
        return cfg

    # ---- media ---------------------------------------------------------------------------
    def supported_modalities(self) -> set[str]:
        out = set()
        if self.vision_tower is not None:
            if self.image_token_id is not None:
                out.add("image")
            if self.video_token_id is not None:
                out.add("video")
        if self.audio_tower is not None and self.audio_token_id is not None:
            out.add("audio")
        return out

    def placeholder_token_ids(self) -> dict[str, int]:
        ids = {"image": self.image_token_id, "video": self.video_token_id, "audio": self.audio_token_id}
        return {m: t for m, t in ids.items() if t is not None}

    def embed_media(self, modality: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Soft tokens of one media item, [tokens, hidden], in the order of its placeholders."""
        dev = next(self.vision_tower.parameters() if modality != "audio" else self.audio_tower.parameters())
        dtype, device = dev.dtype, dev.device
        if modality in ("image", "video"):
            key = "pixel_values" if modality == "image" else "pixel_values_videos"
            pos_key = "image_position_ids" if modality == "image" else "video_position_ids"
            pixels = tensors[key].to(device, dtype)
            pos = tensors[pos_key].to(device)
            if pixels.dim() == 2:
                pixels, pos = pixels[None], pos[None]
            hidden = self.vision_tower(pixel_values=pixels, pixel_position_ids=pos).last_hidden_state
            if hidden.dim() == 3:  # older layouts keep the padding: drop it
                k2 = self.pooling_kernel_size ** 2
                keep = (pos != -1).all(-1).sum(-1) // k2
                hidden = torch.cat([h[:int(n)] for h, n in zip(hidden, keep)])
            return self.embed_vision(inputs_embeds=hidden)
        if modality == "audio":
            feats = tensors["input_features"].to(device, dtype)
            mask = tensors["input_features_mask"].to(device)
            if feats.dim() == 2:
                feats, mask = feats[None], mask[None]
            out = self.audio_tower(feats, mask.bool(), return_dict=True)
            hidden = self.embed_audio(inputs_embeds=out.last_hidden_state)
            return hidden[out.attention_mask.to(hidden.device).bool()]
        raise ValueError(f"unknown modality {modality!r}")

    def embed_with_media(self, input_ids: torch.Tensor, rows: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Text embeddings of input_ids (placeholders already replaced by the pad id) with `features`
        written at `rows`."""
        x = self.model.embed(input_ids)
        if rows.numel():
            x = x.index_copy(0, rows, features.to(x.dtype))
        return x

    # ---- weights -------------------------------------------------------------------------
    def hf_to_ours(self, name: str) -> str | None:
        for prefix, ours in _TOWER_PREFIXES.items():
            for p in (prefix, prefix[len("model."):]):
                if name.startswith(p):
                    if getattr(self, ours[:-1]) is None:
                        return None  # no such tower here (another pipeline stage, or not built)
                    return ours + name[len(p):]
        return super().hf_to_ours(name)


__all__ = ["Gemma4ForConditionalGeneration"]
