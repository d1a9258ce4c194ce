"""Gemma 4 text model in plain PyTorch.

Tokens arrive flattened ([num_tokens]) with their positions; attention goes through the paged
attention op, so the model holds no cache itself. Parameter names follow the Hugging Face
checkpoint (model.layers.N.self_attn.q_proj.weight, ...), so loading is a rename at most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compiled_llm.models.gemma4_config import Gemma4TextConfig, LayerShape
from compiled_llm.ops.attention import AttentionSpec, attention
from compiled_llm.ops.rope import apply_rope, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig, idx: int):
        super().__init__()
        shape: LayerShape = cfg.layers[idx]
        self.idx = idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.shares_kv = shape.kv_source != idx
        self.k_eq_v = shape.k_eq_v
        rope = cfg.rope_for(shape.layer_type)
        self.register_buffer("inv_freq", rope_inv_freq(
            shape.head_dim, rope["rope_theta"], rope.get("rope_type", "default"),
            rope.get("partial_rotary_factor", 1.0), rope.get("factor", 1.0)), persistent=False)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        if not self.shares_kv:
            self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
            self.v_proj = None if self.k_eq_v else nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, eps)
            self.v_norm = RMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.spec = AttentionSpec(
            layer_idx=idx, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            sliding_window=shape.sliding_window, cache_layer=shape.kv_source, scale=1.0, k_eq_v=shape.k_eq_v)

    def attention_spec(self) -> AttentionSpec:
        if self.k_eq_v and not self.shares_kv:
            self.spec.k_norm_weight = self.k_norm.weight
            self.spec.inv_freq = self.inv_freq
        return self.spec

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))
        q = apply_rope(q, positions, self.inv_freq)
        k = v = None
        if not self.shares_kv:
            k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
            v = k if self.v_proj is None else self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
            k = apply_rope(self.k_norm(k), positions, self.inv_freq)
            v = self.v_norm(v)
            k, v = k.reshape(n, -1), v.reshape(n, -1)
        out = attention(q.reshape(n, -1), k, v, self.idx)
        return self.o_proj(out)


class Router(nn.Module):
    """Gemma 4 router: unscaled RMSNorm, learned scale, softmax over experts, top-k, renormalise,
    then a per-expert scale."""

    def __init__(self, cfg: Gemma4TextConfig):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.root_size = cfg.hidden_size ** -0.5
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * self.root_size
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Experts(nn.Module):
    """Routed experts with packed [gate, up] weights: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, cfg: Gemma4TextConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(gelu_tanh(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig, idx: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, idx)
        self.mlp = MLP(h, cfg.layers[idx].intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.moe = cfg.enable_moe_block
        if self.moe:
            self.router = Router(cfg)
            self.experts = Experts(cfg)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.ple = cfg.hidden_size_per_layer_input
        if self.ple:
            self.per_layer_input_gate = nn.Linear(h, self.ple, bias=False)
            self.per_layer_projection = nn.Linear(self.ple, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        residual = x
        x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions))
        x = residual + x

        residual = x
        y = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            weights, ids = self.router(residual)
            routed = self.experts(self.pre_feedforward_layernorm_2(residual), weights, ids)
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(routed)
        x = residual + self.post_feedforward_layernorm(y)

        if self.ple:
            gate = gelu_tanh(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_scale = h ** 0.5
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.ple = cfg.hidden_size_per_layer_input
        if self.ple:
            n = cfg.num_hidden_layers
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, n * self.ple)
            self.per_layer_model_projection = nn.Linear(h, n * self.ple, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.ple, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        return self.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=w.dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """PLE: token-identity table plus a projection of the embeddings, [tokens, layers, ple_dim]."""
        n, layers = input_ids.shape[0], self.cfg.num_hidden_layers
        table = self.embed_tokens_per_layer.weight
        tok = self.embed_tokens_per_layer(input_ids) * torch.tensor(self.ple ** 0.5, dtype=table.dtype)
        proj = self.per_layer_model_projection(embeds) * (self.cfg.hidden_size ** -0.5)
        proj = self.per_layer_projection_norm(proj.view(n, layers, self.ple))
        return (proj + tok.view(n, layers, self.ple)) * (2.0 ** -0.5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        ple = self.per_layer_inputs(input_ids, x) if self.ple else None
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, ple[:, i] if ple is not None else None)
        return self.norm(x)


class Gemma4ForCausalLM(nn.Module):
    """Text-only Gemma 4. Also serves Gemma4ForConditionalGeneration checkpoints' language model."""

    supports_pipeline_parallel = False
    supports_multimodal = False
    uses_mrope = False

    def __init__(self, cfg: Gemma4TextConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Gemma4Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def config_from_hf(cls, hf: dict) -> Gemma4TextConfig:
        text = hf.get("text_config") or hf
        return Gemma4TextConfig.from_dict(text, top=hf)

    def attention_specs(self) -> dict[int, AttentionSpec]:
        return {layer.self_attn.idx: layer.self_attn.attention_spec() for layer in self.model.layers}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(hidden, w)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @staticmethod
    def hf_to_ours(name: str) -> str | None:
        """Checkpoint tensor name -> parameter name, or None to skip it."""
        for prefix in ("model.language_model.", "language_model.model.", "model.text_model."):
            if name.startswith(prefix):
                return "model." + name[len(prefix):]
        if name.startswith(("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                            "vision_tower.", "audio_tower.", "multi_modal_projector.")):
            return None  # multimodal towers: not used by the text model
        return name

    def skip_missing(self, name: str) -> bool:
        return False
