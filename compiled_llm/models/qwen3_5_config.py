"""Qwen3.5 / Qwen3.6 text config (dense and MoE), read from config.json.

Accepts the text config of a ForCausalLM checkpoint or the `text_config` of a ForConditionalGeneration
one, with rope settings either in `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
(older layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class Qwen3_5TextConfig:
    moe_op: ClassVar[str] = "swiglu_moe"  # the routed-expert op its MoE layers call
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: list[str]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    # rotary
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: list[int]
    mrope_interleaved: bool
    # gated delta net
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    # MoE (num_experts == 0: dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """The channels of a full-attention head that M-RoPE rotates (2 x ops/mrope.py rotary_inv_freq's length)."""
        return 2 * len(range(0, int(self.head_dim * self.partial_rotary_factor), 2))

    @classmethod
    def from_dict(cls, cfg: dict, top: dict | None = None, moe: bool = False) -> "Qwen3_5TextConfig":
        """cfg: the text config dict; top: the enclosing multimodal config, if any (tying, dtype, eos)."""
        top = top or cfg
        n = cfg["num_hidden_layers"]
        interval = cfg.get("full_attention_interval", 4)
        layer_types = list(cfg.get("layer_types") or [LINEAR if (i + 1) % interval else FULL for i in range(n)])
        if len(layer_types) != n or set(layer_types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types must list {n} entries of {LINEAR!r} / {FULL!r}")
        rope = dict(cfg.get("rope_scaling") or {})
        rope.update(cfg.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"unsupported rope_type {rope_type!r} for Qwen3.5 (supported: default)")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id", top.get("eos_token_id"))
        c = cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,
            num_hidden_layers=n,
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            layer_types=layer_types,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            attention_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
            mrope_section=list(rope.get("mrope_section") or [11, 11, 10]),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
            linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
            linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
            linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
            eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=cfg.get("bos_token_id", top.get("bos_token_id")),
            pad_token_id=cfg.get("pad_token_id", top.get("pad_token_id")),
            torch_dtype=top.get("torch_dtype") or top.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype"),
        )
        if moe:
            c.num_experts = cfg.get("num_experts", 256)
            c.num_experts_per_tok = cfg.get("num_experts_per_tok", 8)
            c.moe_intermediate_size = cfg.get("moe_intermediate_size", 512)
            c.shared_expert_intermediate_size = cfg.get("shared_expert_intermediate_size", 512)
        if c.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {c.hidden_act!r} for Qwen3.5 (supported: silu)")
        if c.linear_num_value_heads % c.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        return c
