"""max_model_len against the checkpoint's trained context: longer is refused unless forced.

RoPE tables and sliding-window plans are only meaningful up to max_position_embeddings; a longer
max_model_len "works" and then produces garbage past the trained length, so it has to be asked for
explicitly (allow_long_max_model_len, as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN). Read from config.json
before any weight is loaded, so a wrong flag fails in a second, not after the load."""

from __future__ import annotations

import json
from pathlib import Path

from compiled_llm.config import EngineConfig


def checkpoint_max_len(model_path: str) -> int | None:
    """The checkpoint's max_position_embeddings as its model class reads it (None when unreadable: the
    executor then reports the real problem)."""
    from compiled_llm.models.registry import resolve_model_class

    try:
        hf = json.loads((Path(model_path) / "config.json").read_text())
        return int(resolve_model_class(hf).config_from_hf(hf).max_position_embeddings)
    except Exception:  # noqa: BLE001 - the loader raises the precise error later
        return None


def check_max_model_len(config: EngineConfig) -> None:
    if config.max_model_len is None or config.allow_long_max_model_len:
        return
    limit = checkpoint_max_len(config.resolved_model())
    if limit is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len ({config.max_model_len}) is longer than this checkpoint's context "
                         f"(max_position_embeddings = {limit}); lower it, or pass allow_long_max_model_len=True "
                         "(--allow-long-max-model-len) to force it (outputs past the trained context may be wrong)")
