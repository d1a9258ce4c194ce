"""Qwen3.5 / Qwen3.6 text model (dense and MoE) in plain PyTorch.

A hybrid stack: Gated DeltaNet linear-attention layers (causal conv1d + gated delta rule, with
per-sequence recurrent state) and gated full-attention layers (output gate, q/k norms, partial
M-RoPE). Tokens arrive flattened with their positions ([tokens], or [3, tokens] for M-RoPE);
full attention goes through the paged attention op, recurrent state through the state ops, both
fed by the forward context. Norms are zero-centred (scale 1 + weight) except the gated output norm
of the linear layers. Parameter names follow the Hugging Face checkpoint.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from compiled_llm.models.qwen3_5_config import FULL, LINEAR, Qwen3_5TextConfig
from compiled_llm.ops.attention import AttentionSpec, attention
from compiled_llm.ops.conv1d import causal_conv1d
from compiled_llm.ops.delta_rule import gated_delta_rule
from compiled_llm.ops.mrope import apply_mrope, mrope_cos_sin, mrope_owner, rotary_inv_freq
from compiled_llm.ops.state import StateSpec
from compiled_llm.ops.swiglu_moe import swiglu_moe


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + weight), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """Output norm of the linear-attention layers: weight * x / rms(x) * silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * h * F.silu(gate.float())).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts, packed: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return swiglu_moe(x, weights, ids, self.gate_up_proj, self.down_proj)


class SparseMoE(nn.Module):
    """Softmax top-k router (renormalised), routed experts, plus a shared expert behind a sigmoid gate."""

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)
        routed = self.experts(x, weights, ids)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Attention(nn.Module):
    """Full attention with a sigmoid output gate; q_proj yields [query, gate] per head."""

    def __init__(self, cfg: Qwen3_5TextConfig, idx: int):
        super().__init__()
        self.idx = idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = d = cfg.head_dim
        h, bias, eps = cfg.hidden_size, cfg.attention_bias, cfg.rms_norm_eps
        self.q_proj = nn.Linear(h, self.num_heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, eps)
        self.k_norm = RMSNorm(d, eps)
        self.spec = AttentionSpec(layer_idx=idx, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                  head_dim=d, sliding_window=None, cache_layer=idx, scale=d ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(n, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, d))
        q, k = apply_mrope(q, k, cos, sin)
        out = attention(q.reshape(n, -1), k.reshape(n, -1), self.v_proj(x), self.idx)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class GatedDeltaNet(nn.Module):
    """Linear attention: in_proj_qkv -> causal conv1d (SiLU) -> q, k, v; gated delta rule with
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); gated RMSNorm with z; out_proj."""

    def __init__(self, cfg: Qwen3_5TextConfig, idx: int):
        super().__init__()
        self.idx = idx
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def state_spec(self) -> StateSpec:
        return StateSpec(self.idx,
                         shapes={"conv": (self.conv_dim, self.kernel - 1),
                                 "ssm": (self.num_v_heads, self.head_k_dim, self.head_v_dim)},
                         dtypes={"ssm": torch.float32})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        mixed = causal_conv1d(self.in_proj_qkv(x), self.conv1d.weight.squeeze(1), self.idx)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = gated_delta_rule(q.reshape(n, self.num_k_heads, self.head_k_dim),
                               k.reshape(n, self.num_k_heads, self.head_k_dim),
                               v.reshape(n, self.num_v_heads, self.head_v_dim), g, beta, self.idx)
        z = self.in_proj_z(x).view(n, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(out, z).reshape(n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3_5TextConfig, idx: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, idx)
        else:
            self.self_attn = Attention(cfg, idx)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else MLP(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h) if self.layer_type == LINEAR else self.self_attn(h, cos, sin)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq = rotary_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.partial_rotary_factor)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("mrope_owner", mrope_owner(len(inv_freq), cfg.mrope_section, cfg.mrope_interleaved),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.mrope_owner, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 dense text model (the conditional-generation checkpoints: models/qwen3_5_mm.py)."""

    supports_pipeline_parallel = False
    supports_multimodal = False
    uses_mrope = True
    moe = False

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3_5Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def config_from_hf(cls, hf: dict) -> Qwen3_5TextConfig:
        text = hf.get("text_config") or hf
        return Qwen3_5TextConfig.from_dict(text, top=hf, moe=cls.moe)

    def attention_specs(self) -> dict[int, AttentionSpec]:
        return {layer.self_attn.idx: layer.self_attn.spec for layer in self.model.layers if layer.layer_type == FULL}

    def expected_fusions(self) -> dict[int, dict[str, int]]:
        """None of our passes matches Qwen3.5's graphs yet (zero-centred norms, M-RoPE, softmax router; its
        routed experts call swiglu_moe directly, so nothing falls back to the dense sum)."""
        return {i: {} for i in range(self.cfg.num_hidden_layers)}

    def state_specs(self) -> dict[int, StateSpec]:
        """Per-sequence recurrent state of each linear-attention layer."""
        return {layer.linear_attn.idx: layer.linear_attn.state_spec()
                for layer in self.model.layers if layer.layer_type == LINEAR}

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """positions: [tokens], or [3, tokens] (M-RoPE) for prompts with images or videos, whose
        embeddings then come in inputs_embeds (see models/qwen3_5_vision.py)."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, w)

    def hf_to_ours(self, name: str):
        """Checkpoint tensor name -> parameter name, (parameter name, index) for a slice of a packed
        parameter (per-expert MoE weights), or None to skip it."""
        if name.startswith("mtp.") or name.endswith("rotary_emb.inv_freq"):
            return None  # multi-token-prediction head: not used
        for prefix in ("model.language_model.", "language_model.model."):
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
                break
        if name.startswith(("model.visual.", "visual.")):
            return None  # vision tower of a conditional-generation checkpoint (loaded by models/qwen3_5_mm.py)
        if name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None
        m = _EXPERT.match(name)
        if m:
            base, e, proj = m.group(1), int(m.group(2)), m.group(3)
            i = self.cfg.moe_intermediate_size
            if proj == "down_proj":
                return f"{base}.down_proj", (e,)
            return f"{base}.gate_up_proj", (e, slice(0, i) if proj == "gate_proj" else slice(i, 2 * i))
        return name

    def skip_missing(self, name: str) -> bool:
        return False


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 MoE: every layer's MLP is routed experts plus a gated shared expert."""

    moe = True
