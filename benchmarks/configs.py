"""Released Gemma 4 and Qwen3.5 MoE text shapes, for benchmarks with random weights (--load-format dummy)."""

from __future__ import annotations

import json
import tempfile
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

# Qwen3.5-35B-A3B text model: 3 Gated DeltaNet layers then 1 gated full-attention layer, MoE in every layer.
QWEN3_5_35B_A3B = {
    "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "vocab_size": 248320,
}
# partial rotary over a quarter of head_dim, interleaved M-RoPE; section as transformers' Qwen3_5 default
_QWEN_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
              "mrope_section": [11, 11, 10], "mrope_interleaved": True}

PRESETS = {"gemma-4-26b-a4b": GEMMA4_26B_A4B, "gemma-4-31b": GEMMA4_31B, "gemma-4-e4b": GEMMA4_E4B,
           "qwen3.5-35b-a3b": QWEN3_5_35B_A3B}


def qwen_layer_types(layers: int, interval: int = 4) -> list[str]:
    """interval - 1 linear-attention layers, then one full-attention layer, repeated."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def qwen_config(shape: dict, max_position_embeddings: int = 131072) -> dict:
    """A flat Qwen3.5 MoE text config (what Qwen3_5TextConfig.from_dict reads) for a shape dict."""
    text = dict(shape)
    text.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], rope_parameters=_QWEN_ROPE,
                layer_types=qwen_layer_types(text["num_hidden_layers"], text.get("full_attention_interval", 4)),
                rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
                max_position_embeddings=max_position_embeddings, torch_dtype="bfloat16")
    return text


def config_dict(name: str, max_position_embeddings: int = 131072) -> dict:
    if name.startswith("qwen"):
        return qwen_config(PRESETS[name], max_position_embeddings)
    text = dict(PRESETS[name])
    text.update(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], rope_parameters=_ROPE,
                layer_types=_pattern(text["num_hidden_layers"]), rms_norm_eps=1e-6,
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=max_position_embeddings,
                tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0,
                torch_dtype="bfloat16")
    return text


def write_config_folder(cfg: dict, folder: Path) -> Path:
    """A folder with config.json only: enough for load_format='dummy' with skip_tokenizer_init."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def write_checkpoint_folder(name: str, folder: Path) -> Path:
    return write_config_folder(config_dict(name), folder)


def add_model_args(ap, device: str = "cuda") -> None:
    """The engine-building scripts' model arguments: a preset config with dummy weights, or a checkpoint folder."""
    ap.add_argument("--config", choices=sorted(PRESETS), default="gemma-4-26b-a4b")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a preset config")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=device)


def model_folder(args) -> str:
    """--model, or a fresh folder holding --config's config.json."""
    return args.model or str(write_checkpoint_folder(args.config, Path(tempfile.mkdtemp()) / args.config))


def write_word_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A tokenizer for a dummy-weight checkpoint served over HTTP (the serving benchmark): one word per id
    ("w17"), so every sampled id, whatever the random weights pick, decodes to text a streaming client sees.
    Ids 0, 1, 2 are <pad>, <eos>, <bos> as in the presets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.save_pretrained(folder)
    return folder
