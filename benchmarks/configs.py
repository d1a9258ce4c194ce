"""Released Gemma 4 text shapes, for benchmarks with random weights (--load-format dummy)."""

from __future__ import annotations

import json
from pathlib import Path

_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


def _pattern(layers: int) -> list[str]:
    return (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6)


GEMMA4_31B = {
    "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60, "num_attention_heads": 32,
    "num_key_value_heads": 16, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
    "attention_k_eq_v": True, "sliding_window": 1024, "final_logit_softcapping": 30.0, "vocab_size": 262144,
    "enable_moe_block": False, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
}
GEMMA4_26B_A4B = {
    **GEMMA4_31B, "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
    "num_key_value_heads": 8, "num_global_key_value_heads": 2, "enable_moe_block": True, "num_experts": 128,
    "top_k_experts": 8, "moe_intermediate_size": 704,
}
GEMMA4_E4B = {
    "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": False,
    "sliding_window": 512, "final_logit_softcapping": 30.0, "vocab_size": 262144, "enable_moe_block": False,
    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 18,
}

PRESETS = {"gemma-4-26b-a4b": GEMMA4_26B_A4B, "gemma-4-31b": GEMMA4_31B, "gemma-4-e4b": GEMMA4_E4B}


def config_dict(name: str, max_position_embeddings: int = 131072) -> dict:
    text = dict(PRESETS[name])
    text.update(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], rope_parameters=_ROPE,
                layer_types=_pattern(text["num_hidden_layers"]), rms_norm_eps=1e-6,
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=max_position_embeddings,
                tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0,
                torch_dtype="bfloat16")
    return text


def write_checkpoint_folder(name: str, folder: Path) -> Path:
    """A folder with config.json only: enough for load_format='dummy' with skip_tokenizer_init."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_dict(name), indent=1))
    return folder
