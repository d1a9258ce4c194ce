"""Qwen3.5 / Qwen3.6 text model (dense and MoE) in plain PyTorch.

A hybrid stack: Gated DeltaNet linear-attention layers (causal conv1d + gated delta rule, with
per-sequence recurrent state) and gated full-attention layers (output gate, q/k norms, partial
M-RoPE). Tokens arrive flattened with their positions ([tokens], or [3, tokens] for M-RoPE);
full attention goes through the paged attention op, recurrent state through the state ops, both
fed by the forward context. Norms are zero-centred (scale 1 + weight) except the gated output norm
of the linear layers. Parameter names follow the Hugging Face checkpoint.

Tensor parallel (models/parallel_layers.py; at size 1 every layer is the plain one): full attention is split
by heads (the gated q_proj by whole [query, gate] heads, KV heads replicated where there are fewer than
ranks), a linear-attention layer by key-head groups (a rank holds K/tp key heads and the V/tp value heads
they serve, the matching rows of each segment of the merged [q; k; v; z; b; a] input projection, conv
channels, dt_bias and A_log, so its conv and delta-rule state are per rank too), the MLPs column/row, the
routed experts by intermediate size or (expert parallel) whole experts, the vocabulary across ranks; norms
and the router are replicated.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from compiled_llm.distributed.parallel_state import get_parallel_state
from compiled_llm.models.interfaces import HasRecurrentState, SupportsEP, SupportsTP, UsesMRoPE
from compiled_llm.models.layers import GatedExperts, GatedMLP, RMSNorm
from compiled_llm.models.parallel_layers import (MergedColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                                 VocabParallelEmbedding, divide, head_rows, local_num_heads,
                                                 segment_parameter)
from compiled_llm.models.qwen3_5_config import FULL, LINEAR, Qwen3_5TextConfig
from compiled_llm.ops.attention import AttentionSpec, attention
from compiled_llm.ops.delta_rule import gated_delta_rule, gated_rms_norm
from compiled_llm.ops.moe import ref_softmax_router_topk
from compiled_llm.ops.mrope import apply_mrope, mrope_cos_sin, mrope_owner, rotary_inv_freq
from compiled_llm.ops.state import StateSpec
from compiled_llm.ops.swiglu_moe import swiglu_moe


ZERO_CENTRED = 1.0  # the norms' weight offset (models/layers/norm.py): they scale by 1 + weight


class GatedRMSNorm(nn.Module):
    """Output norm of the linear-attention layers: weight * x / rms(x) * silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # (the delta-rule op applies it)
        return gated_rms_norm(x, gate, self.weight, self.eps)


class Experts(GatedExperts):
    """Routed SwiGLU experts (models/layers/experts.py), loaded from packed or per-expert checkpoint tensors:
    eager through the swiglu_moe op over the picked experts, compiled as the dense sum (`dense_gated_moe`
    with a SiLU gate) that the SwiGLU MoE pass turns into the same routed op."""

    routed_op = staticmethod(swiglu_moe)

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                         F.silu)


class SparseMoE(nn.Module):
    """Softmax top-k router (renormalised), routed experts, plus a shared expert behind a sigmoid gate."""

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, F.silu, reduce=False)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)  # replicated, like the router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ref_softmax_router_topk(x, self.gate.weight, self.top_k)  # what the router fusion searches for
        weights = weights.to(x.dtype)  # the router's logits' dtype, as transformers casts
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # this rank's partial sum
        return self.experts(x, weights, ids, shared)


class Attention(nn.Module):
    """Full attention with a sigmoid output gate; q_proj yields [query, gate] per head."""

    def __init__(self, cfg: Qwen3_5TextConfig, idx: int):
        super().__init__()
        self.idx = idx
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads = local_num_heads(heads)  # this rank's heads (all of them at TP 1)
        self.num_kv_heads = local_num_heads(kv_heads)
        self.head_dim = d = cfg.head_dim
        h, bias, eps = cfg.hidden_size, cfg.attention_bias, cfg.rms_norm_eps
        # [q; k; v] in one GEMM, each segment split by whole heads; a q head's rows are [query; gate]
        self.qkv_proj = MergedColumnParallelLinear(
            h, [heads * 2 * d, kv_heads * d, kv_heads * d], bias=bias,
            ranges=[head_rows(heads, 2 * d), head_rows(kv_heads, d), head_rows(kv_heads, d)])
        self.o_proj = RowParallelLinear(heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, eps, ZERO_CENTRED)
        self.k_norm = RMSNorm(d, eps, ZERO_CENTRED)
        self.spec = AttentionSpec(layer_idx=idx, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                  head_dim=d, sliding_window=None, cache_layer=idx, scale=d ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        y = self.qkv_proj(x)
        sq, sk, _ = self.qkv_proj.local_sizes
        q, gate = split_heads(y, 0, sq, self.num_heads).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(split_heads(y, sq, sk, self.num_kv_heads))
        v = y[:, sq + sk:]
        q, k = apply_mrope(q, k, cos, sin)  # with the norms and the KV write: what the QK-norm + M-RoPE fusion takes
        out = attention(q.reshape(n, -1), k.reshape(n, -1), v, self.idx)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


def split_heads(y: torch.Tensor, start: int, width: int, heads: int) -> torch.Tensor:
    """Columns [start, start + width) of y [tokens, columns] (a whole tensor: a projection's or an op's fresh
    output) as [tokens, heads, width / heads].

    A view (reshape, unflatten) of a column slice makes Dynamo and Inductor prove the token count is not 1, a
    guard that a one-token batch then fails: the whole forward compiled a second time at start-up (19 s of
    Qwen3.5 35B-A3B's cold start on the H200, session 13). So the strides are stated, and the slice's storage
    offset too: torch 2.11's Inductor lowers as_strided of a view on the view's base and takes a missing
    offset as 0, so every slice read y's first columns (every compiled Qwen3.5 forward on the GPU, whose
    torch is 2.11, from session 13 to 19; 2.14 keeps the offset; Dynamo cannot trace x.storage_offset())."""
    if not torch.compiler.is_compiling():  # (the offset given is y's own plus start)
        assert y.storage_offset() == 0 and y.stride(1) == 1, (y.storage_offset(), y.stride())
    d = width // heads
    x = y[:, start:start + width]
    return x.as_strided((x.shape[0], heads, d), (x.stride(0), d, x.stride(1)), start)


class DepthwiseConvWeight(nn.Module):
    """The depthwise causal conv's weight [channels, 1, kernel] under the checkpoint's name (conv1d.weight),
    holding this rank's channels: its slices of the [q; k; v] segments, in in_proj_qkv's output order. The
    conv itself runs in the gated_delta_rule op (through the causal_conv1d op, which keeps the per-sequence
    window in the recurrent state; at decode on the GPU inside the recurrence's launch)."""

    def __init__(self, sizes: list[int], kernel: int):
        super().__init__()
        self.weight = segment_parameter((sum(sizes), 1, kernel), sizes, "linear-attention conv channels")


class GatedDeltaNet(nn.Module):
    """Linear attention: in_proj -> [q; k; v] through causal conv1d (SiLU), z, b, a; gated delta rule with
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); gated RMSNorm with z; out_proj.

    The checkpoint's four projections of the input (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) are the
    segments of one merged projection, `in_proj` ([q; k; v; z; b; a], loaded by `hf_to_ours`): one GEMM a
    layer instead of four small ones, each of which costs a launch at decode. The delta-rule op's conv reads the
    [q; k; v] columns of its output in place (a row-strided view: every conv provider takes a row stride).

    Key head j serves the value heads [j * V/K, (j + 1) * V/K) (the delta rule repeats each k head over
    consecutive v heads), so an even split of both head counts gives every rank whole groups: K/tp key
    heads and the V/tp value heads they serve. in_proj_qkv holds [q (K heads); k (K heads); v (V heads)]
    as three blocks (not interleaved per group as in Qwen3-Next's fused in_proj_qkvz), each split evenly, as
    are z (V heads), b and a (one per value head)."""

    def __init__(self, cfg: Qwen3_5TextConfig, idx: int):
        super().__init__()
        self.idx = idx
        tp = get_parallel_state().tp_size
        k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.num_k_heads = divide(k_heads, tp, "linear-attention key heads")  # this rank's
        self.num_v_heads = divide(v_heads, tp, "linear-attention value heads")
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        qkv = [k_heads * self.head_k_dim] * 2 + [v_heads * self.head_v_dim]  # in_proj_qkv's segments
        self.in_proj = MergedColumnParallelLinear(h, qkv + [v_heads * self.head_v_dim, v_heads, v_heads])
        self.conv1d = DepthwiseConvWeight(qkv, self.kernel)
        self.dt_bias = segment_parameter((v_heads,), [v_heads], "linear-attention value heads")
        self.A_log = segment_parameter((v_heads,), [v_heads], "linear-attention value heads")
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(v_heads * self.head_v_dim, h)

    def state_spec(self) -> StateSpec:
        """This rank's state per sequence: the conv window of its channels, the delta-rule matrix of its heads."""
        return StateSpec(self.idx,
                         shapes={"conv": (self.conv_dim, self.kernel - 1),
                                 "ssm": (self.num_v_heads, self.head_k_dim, self.head_v_dim)},
                         dtypes={"ssm": torch.float32})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        y = self.in_proj(x)
        qkv, _, ba = y.split([self.conv_dim, self.value_dim, 2 * self.num_v_heads], -1)
        z = split_heads(y, self.conv_dim, self.value_dim, self.num_v_heads)
        # the op runs the causal conv over [q; k; v] (its window in the layer's state), computes the decay and beta
        # from [b; a] and applies the gated output norm (ops/delta_rule.py)
        out = gated_delta_rule(qkv, self.conv1d.weight.squeeze(1), ba, self.A_log, self.dt_bias, z, self.norm.weight,
                               self.norm.eps, self.num_k_heads, self.idx)
        return self.out_proj(out.reshape(n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3_5TextConfig, idx: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, idx)
        else:
            self.self_attn = Attention(cfg, idx)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else GatedMLP(h, cfg.intermediate_size, F.silu)
        self.input_layernorm = RMSNorm(h, eps, ZERO_CENTRED)
        self.post_attention_layernorm = RMSNorm(h, eps, ZERO_CENTRED)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h) if self.layer_type == LINEAR else self.self_attn(h, cos, sin)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ZERO_CENTRED)
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


_QKV = re.compile(r"(.*\.self_attn)\.(q_proj|k_proj|v_proj)\.(weight|bias)$")  # full-attention layers
_MLP = re.compile(r"(.*\.mlp(?:\.shared_expert)?)\.(gate_proj|up_proj)\.weight$")  # dense MLP, shared expert
_LINEAR = re.compile(r"(.*\.linear_attn)\.in_proj_(qkv|z|b|a)\.weight$")  # linear-attention layers
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3_5ForCausalLM(nn.Module, HasRecurrentState, UsesMRoPE, SupportsTP, SupportsEP):
    """Qwen3.5 dense text model (the conditional-generation checkpoints: models/qwen3_5_mm.py)."""

    moe = False

    def __init__(self, cfg: Qwen3_5TextConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3_5Model(cfg)
        tied = cfg.tie_word_embeddings
        self.lm_head = self.model.embed_tokens if tied else ParallelLMHead(cfg.vocab_size, cfg.hidden_size)

    @classmethod
    def config_from_hf(cls, hf: dict) -> Qwen3_5TextConfig:
        text = hf.get("text_config") or hf
        return Qwen3_5TextConfig.from_dict(text, top=hf, moe=cls.moe)

    def attention_specs(self) -> dict[int, AttentionSpec]:
        return {layer.self_attn.idx: layer.self_attn.spec for layer in self.model.layers if layer.layer_type == FULL}

    def expected_fusions(self) -> dict[int, dict[str, int]]:
        """The fusions each layer gets when compiled (compiler/verify.py checks the passes' per-layer counts):
        RMSNorm + residual add twice (the attention residual into the post-attention norm; the MLP residual
        into the next layer's input norm, or the final norm after the last layer: counted at the layer of
        the add), QK-norm + M-RoPE + KV write in full-attention layers, router + top-k and SwiGLU MoE in MoE
        layers. Under tensor parallelism no all-reduce meets a norm directly (a residual add sits between)."""
        out = {}
        for i, layer in enumerate(self.model.layers):
            moe = int(isinstance(layer.mlp, SparseMoE))
            out[i] = {"add_rms_norm": 2, "qk_norm_rope_kv_write": int(layer.layer_type == FULL), "router_topk": moe,
                      "swiglu_moe": moe, "moe_overlap": moe}
        return out

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
        return self.lm_head.logits(hidden)

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
        m = _QKV.match(name)
        if m:  # segments of our merged qkv_proj
            merged = f"{m.group(1)}.qkv_proj"
            return f"{merged}.{m.group(3)}", self.get_submodule(merged).segment(("q_proj", "k_proj", "v_proj").index(m.group(2)))
        m = _LINEAR.match(name)
        if m:  # in_proj_qkv (segments q, k, v), in_proj_z, in_proj_b, in_proj_a: segments of our merged in_proj
            merged = f"{m.group(1)}.in_proj"
            first, count = {"qkv": (0, 3), "z": (3, 1), "b": (4, 1), "a": (5, 1)}[m.group(2)]
            return f"{merged}.weight", self.get_submodule(merged).segment(first, count)
        m = _MLP.match(name)
        if m:  # the checkpoint's gate_proj / up_proj: segments of our merged gate_up_proj (one GEMM)
            merged = f"{m.group(1)}.gate_up_proj"
            return f"{merged}.weight", self.get_submodule(merged).segment(0 if m.group(2) == "gate_proj" else 1)
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
