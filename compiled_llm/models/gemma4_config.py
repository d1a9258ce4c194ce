"""Gemma 4 text config, read from config.json so that every transformers release's layout works.

Older checkpoints give the global layers' shape as `global_head_dim` / `num_global_key_value_heads`;
newer transformers writes a `per_layer_config` of overrides. Both resolve to one LayerShape per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class LayerShape:
    layer_type: str  # "sliding_attention" | "full_attention"
    head_dim: int
    num_kv_heads: int
    sliding_window: int | None
    k_eq_v: bool
    kv_source: int  # layer whose cache this layer reads
    intermediate_size: int


@dataclass
class Gemma4TextConfig:
    moe_op: ClassVar[str] = "geglu_moe"  # the routed-expert op its MoE layers call
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: list[str]
    sliding_window: int
    rope_parameters: dict
    max_position_embeddings: int
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    num_kv_shared_layers: int
    attention_k_eq_v: bool
    enable_moe_block: bool
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    hidden_activation: str
    layers: list[LayerShape] = field(default_factory=list)
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    @classmethod
    def from_dict(cls, cfg: dict, top: dict | None = None) -> "Gemma4TextConfig":
        """cfg: the text config dict; top: the enclosing multimodal config, if any (tying, dtype)."""
        top = top or cfg
        n = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)
        ]
        layer_types = list(layer_types)
        layer_types[-1] = "full_attention"  # transformers forces this too
        eos = cfg.get("eos_token_id", top.get("eos_token_id", 1))
        c = cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n,
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim", 256),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            layer_types=layer_types,
            sliding_window=cfg.get("sliding_window", 512),
            rope_parameters=cfg.get("rope_parameters") or {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            },
            max_position_embeddings=cfg.get("max_position_embeddings", 131072),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            tie_word_embeddings=top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True)),
            hidden_size_per_layer_input=cfg.get("hidden_size_per_layer_input") or 0,
            vocab_size_per_layer_input=cfg.get("vocab_size_per_layer_input", cfg["vocab_size"]),
            num_kv_shared_layers=cfg.get("num_kv_shared_layers", 0) or 0,
            attention_k_eq_v=bool(cfg.get("attention_k_eq_v", False)),
            enable_moe_block=bool(cfg.get("enable_moe_block", False)),
            num_experts=cfg.get("num_experts") or 0,
            top_k_experts=cfg.get("top_k_experts") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
            hidden_activation=cfg.get("hidden_activation", "gelu_pytorch_tanh"),
            eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=cfg.get("bos_token_id", top.get("bos_token_id")),
            pad_token_id=cfg.get("pad_token_id", top.get("pad_token_id")),
            torch_dtype=top.get("torch_dtype") or top.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype"),
        )
        if cfg.get("use_bidirectional_attention") == "all":
            raise ValueError("Gemma 4 with use_bidirectional_attention='all' is not a causal LM and is not supported")
        if c.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {c.hidden_activation!r}")
        c.layers = c._resolve_layers(cfg)
        return c

    def _resolve_layers(self, cfg: dict) -> list[LayerShape]:
        overrides: dict[int, dict] = {}
        if isinstance(cfg.get("per_layer_config"), dict):
            for key, val in cfg["per_layer_config"].items():
                if str(key).isdigit():
                    overrides[int(key)] = dict(val)
        else:
            full = {"head_dim": cfg.get("global_head_dim", 512)}
            if self.attention_k_eq_v and cfg.get("num_global_key_value_heads") is not None:
                full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
            overrides = {i: full for i, t in enumerate(self.layer_types) if t == "full_attention"}

        n = self.num_hidden_layers
        first_shared = n - self.num_kv_shared_layers
        if self.num_kv_shared_layers and first_shared <= 0:
            raise ValueError("num_kv_shared_layers must leave at least one layer that computes its own KV")
        # A sharing layer reads the last non-sharing layer of its own type.
        source_of_type = {t: max(i for i in range(first_shared) if self.layer_types[i] == t)
                          for t in set(self.layer_types[first_shared:])} if self.num_kv_shared_layers else {}
        layers = []
        use_double = cfg.get("use_double_wide_mlp", False)
        for i, t in enumerate(self.layer_types):
            o = overrides.get(i, {})
            sliding = t == "sliding_attention"
            shared = i >= first_shared
            layers.append(LayerShape(
                layer_type=t,
                head_dim=o.get("head_dim", self.head_dim),
                num_kv_heads=o.get("num_key_value_heads", self.num_key_value_heads),
                sliding_window=self.sliding_window if sliding else None,
                k_eq_v=self.attention_k_eq_v and not sliding,
                kv_source=source_of_type[t] if shared else i,
                intermediate_size=self.intermediate_size * (2 if use_double and shared else 1),
            ))
        return layers

    def rope_for(self, layer_type: str) -> dict:
        return self.rope_parameters[layer_type]
