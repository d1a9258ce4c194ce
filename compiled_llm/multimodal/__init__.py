"""Multimodal prompts: media items, their processing by the checkpoint's own processor, media hashes in the
prefix cache, and the per-step merge of media embeddings (docs/multimodal.md)."""

from compiled_llm.multimodal.inputs import MediaItem, MultiModalInputs

__all__ = ["MediaItem", "MultiModalInputs"]
