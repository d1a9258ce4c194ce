"""Gemma 4 text model in plain PyTorch.

Tokens arrive flattened ([num_tokens]) with their positions; attention goes through the paged
attention op, so the model holds no cache itself. Parameter names follow the Hugging Face
checkpoint (model.layers.N.self_attn.o_proj.weight, ...), so loading is a rename at most, except that
q/k/v and the MLP's gate/up are each one merged projection (qkv_proj, gate_up_proj: one GEMM each, which
decode reads at a better share of bandwidth than two or three narrow ones); their checkpoint tensors load
into the merged weight's segments.

Tensor parallel: projections are column/row-parallel layers (models/parallel_layers.py) that hold this
rank's slice and sum partial outputs with an all-reduce, which a compiler pass fuses into the RMSNorm
that follows it; at size 1 they are plain linears. Pipeline parallel: a stage builds its own layers
(placeholders elsewhere) and hands the next stage the hidden states and the PLE per-layer inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from compiled_llm.distributed.parallel_state import get_parallel_state
from compiled_llm.models.gemma4_config import Gemma4TextConfig, LayerShape
from compiled_llm.models.interfaces import SupportsEP, SupportsPP, SupportsTP
from compiled_llm.models.layers import GatedExperts, GatedMLP, RMSNorm
from compiled_llm.models.parallel_layers import (ParallelLMHead, PPMissingLayer, RowParallelLinear,
                                                 VocabParallelEmbedding, head_parallel_segments, local_num_heads,
                                                 make_layers)
from compiled_llm.ops.activation import gelu_tanh
from compiled_llm.ops.attention import AttentionSpec, attention
from compiled_llm.ops.logits import logits_softcap
from compiled_llm.ops.moe import geglu_moe, ref_router_topk
from compiled_llm.ops.rope import apply_rope, rope_inv_freq, rotated_pairs


class Attention(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig, idx: int):
        super().__init__()
        shape: LayerShape = cfg.layers[idx]
        self.idx = idx
        self.num_heads = local_num_heads(cfg.num_attention_heads)  # this rank's heads (all of them at TP 1)
        self.num_kv_heads = local_num_heads(shape.num_kv_heads)
        self.head_dim = shape.head_dim
        self.shares_kv = shape.kv_source != idx
        self.k_eq_v = shape.k_eq_v
        rope = cfg.rope_for(shape.layer_type)
        rope_type, partial = rope.get("rope_type", "default"), rope.get("partial_rotary_factor", 1.0)
        self.register_buffer("inv_freq", rope_inv_freq(
            shape.head_dim, rope["rope_theta"], rope_type, partial, rope.get("factor", 1.0)), persistent=False)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        # [q; k; v] in one projection (q alone where the layer reads another's cache; no v where K=V)
        kv_projections = 0 if self.shares_kv else (1 if self.k_eq_v else 2)
        self.qkv_proj = head_parallel_segments(
            h, [cfg.num_attention_heads] + [shape.num_kv_heads] * kv_projections, self.head_dim)
        self.local_heads = [n // self.head_dim for n in self.qkv_proj.local_sizes]
        self.q_norm = RMSNorm(self.head_dim, eps)
        if not self.shares_kv:
            self.k_norm = RMSNorm(self.head_dim, eps)
            self.v_norm = RMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, h)
        self.spec = AttentionSpec(
            layer_idx=idx, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            sliding_window=shape.sliding_window, cache_layer=shape.kv_source, scale=1.0, k_eq_v=shape.k_eq_v,
            rotated_pairs=rotated_pairs(shape.head_dim, rope_type, partial))

    def attention_spec(self) -> AttentionSpec:
        self.spec.inv_freq = self.inv_freq  # K=V key rebuild; StreamingLLM re-rotates queries for its sinks
        if self.k_eq_v and not self.shares_kv:
            self.spec.k_norm_weight = self.k_norm.weight
        return self.spec

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        # heads first, then the split: a view of a column slice would guard on n >= 2 and recompile for n = 1
        q, *kv = self.qkv_proj(x).view(n, -1, self.head_dim).split(self.local_heads, dim=1)
        q = apply_rope(self.q_norm(q), positions, self.inv_freq)
        k = v = None
        if not self.shares_kv:
            k = kv[0]
            v = k if self.k_eq_v else kv[1]
            # K=V layers cache only the value; keys are rebuilt from it when read
            k = None if self.k_eq_v else apply_rope(self.k_norm(k), positions, self.inv_freq).reshape(n, -1)
            v = self.v_norm(v).reshape(n, -1)
        out = attention(q.reshape(n, -1), k, v, self.idx)
        return self.o_proj(out)


class Router(nn.Module):
    """Gemma 4 router: unscaled RMSNorm, learned scale, softmax over experts, top-k, renormalise,
    then a per-expert scale (ops/moe.py `ref_router_topk`, which the router fusion searches for)."""

    def __init__(self, cfg: Gemma4TextConfig):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.root_size = cfg.hidden_size ** -0.5
        self.eps = cfg.rms_norm_eps
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ref_router_topk(x, self.proj.weight, self.scale, self.per_expert_scale, self.top_k, self.eps,
                               self.root_size)


class Experts(GatedExperts):
    """Routed GEGLU experts (models/layers/experts.py): eager through the geglu_moe op over the picked experts
    (its chosen provider: the Triton kernel on a GPU, so the start-up's eager profile step does not loop over
    the experts with a host sync each), compiled as the dense sum the GEGLU MoE pass replaces with that op."""

    routed_op = staticmethod(geglu_moe)

    def __init__(self, cfg: Gemma4TextConfig):
        super().__init__(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k_experts, gelu_tanh)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig, idx: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, idx)
        self.mlp = GatedMLP(h, cfg.layers[idx].intermediate_size, gelu_tanh)  # GEGLU over gate_up_proj
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
        if self.moe:  # the routed branch's inputs first: compiled on CUDA it then runs beside the dense MLP
            weights, ids = self.router(residual)  # (passes/moe_overlap.py)
            routed = self.experts(self.pre_feedforward_layernorm_2(residual), weights, ids)
        y = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
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
        n = cfg.num_hidden_layers
        # pipeline stage: layers [start_layer, end_layer); a KV-sharing layer stays with its source
        ps = get_parallel_state()
        links = [(s.kv_source, i) for i, s in enumerate(cfg.layers) if s.kv_source != i]
        self.start_layer, self.end_layer = ps.pp_layer_range(n, links)
        self.is_first, self.is_last = ps.is_first_stage, ps.is_last_stage
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h) if self.is_first else PPMissingLayer()
        self.embed_scale = h ** 0.5
        self.layers = make_layers(n, self.start_layer, self.end_layer, lambda i: DecoderLayer(cfg, i))
        self.norm = RMSNorm(h, cfg.rms_norm_eps) if self.is_last else PPMissingLayer()
        self.ple = cfg.hidden_size_per_layer_input
        if self.ple and self.is_first:  # per-layer inputs are computed up front and travel with the hidden states
            self.embed_tokens_per_layer = VocabParallelEmbedding(cfg.vocab_size_per_layer_input, n * self.ple)
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: dict[str, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        if intermediate is None:
            # inputs_embeds: media embeddings merged in (models/gemma4_mm.py; input_ids hold the pad id there)
            x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            ple = self.per_layer_inputs(input_ids, x) if self.ple else None
        else:  # a later pipeline stage: what the previous stage handed over
            x, ple = intermediate["hidden_states"], intermediate.get("per_layer_inputs")
        # each layer's slice taken up front: a layer then reads a tensor of its own, not a constant index into
        # the whole table, so look-alike layers trace to one graph (the compiler compiles it once)
        per_layer = ple.unbind(1) if ple is not None else [None] * self.cfg.num_hidden_layers
        for i in range(self.start_layer, self.end_layer):
            x = self.layers[i](x, positions, per_layer[i])
        if not self.is_last:
            return {"hidden_states": x} if ple is None else {"hidden_states": x, "per_layer_inputs": ple}
        return self.norm(x)


class Gemma4ForCausalLM(nn.Module, SupportsPP, SupportsTP, SupportsEP):
    """Text-only Gemma 4. Also serves Gemma4ForConditionalGeneration checkpoints' language model."""

    def __init__(self, cfg: Gemma4TextConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Gemma4Model(cfg)
        if self.model.is_last:
            # tied: the embedding is the head, unless it lives on another pipeline stage (then the last
            # stage keeps its own copy, loaded from the embedding's tensor)
            tied_here = cfg.tie_word_embeddings and self.model.is_first
            self.lm_head = self.model.embed_tokens if tied_here else ParallelLMHead(cfg.vocab_size, cfg.hidden_size)

    @classmethod
    def config_from_hf(cls, hf: dict) -> Gemma4TextConfig:
        text = hf.get("text_config") or hf
        return Gemma4TextConfig.from_dict(text, top=hf)

    def attention_specs(self) -> dict[int, AttentionSpec]:
        """The specs of this stage's layers, with this rank's head counts (the KV cache is sized by them)."""
        return {layer.self_attn.idx: layer.self_attn.attention_spec() for layer in self.model.layers
                if not isinstance(layer, PPMissingLayer)}

    def expected_fusions(self) -> dict[int, dict[str, int]]:
        """The fusions each of this stage's layers gets when compiled (compiler/verify.py checks the passes'
        per-layer match counts against this): QK-norm + RoPE (+ KV write) in its attention; RMSNorm +
        residual add after attention, and once more in MoE layers (the summed post-norms are normed again);
        router + top-k and GEGLU MoE in MoE layers, and there the routed branch split onto a side stream
        (moe_overlap, when that pass is on); under tensor parallelism one all-reduce + RMSNorm per row-parallel
        projection (attention out, MLP down, and the experts' combine)."""
        tp = get_parallel_state().tp_size > 1
        out = {}
        for layer in self.model.layers:
            if isinstance(layer, PPMissingLayer):
                continue
            moe = 1 if layer.moe else 0
            out[layer.self_attn.idx] = {"qk_norm_rope_kv_write": 1, "add_rms_norm": 1 + moe, "router_topk": moe,
                                        "geglu_moe": moe, "moe_overlap": moe, "allreduce_rms_norm": (2 + moe) if tp else 0}
        return out

    def intermediate_shapes(self, num_tokens: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What one pipeline stage hands the next, by name: the residual stream (a Gemma layer takes and
        returns that one tensor) and, for PLE models, every layer's per-layer input. Fixed shapes per
        token count, so a CUDA-graph runner can keep static buffers for all of them."""
        out = {"hidden_states": ((num_tokens, self.cfg.hidden_size), dtype)}
        if self.cfg.hidden_size_per_layer_input:
            out["per_layer_inputs"] = ((num_tokens, self.cfg.num_hidden_layers, self.cfg.hidden_size_per_layer_input),
                                       dtype)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: dict[str, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """Hidden states after the final norm; on a pipeline stage before the last, what it hands on."""
        if inputs_embeds is None:
            return self.model(input_ids, positions, intermediate)
        return self.model(input_ids, positions, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:  # float32 (the sampler's dtype), one launch on the GPU
            logits = logits_softcap(logits, cap)
        return logits

    def hf_to_ours(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name, or None to skip it."""
        for prefix in ("model.language_model.", "language_model.model.", "model.text_model."):
            if name.startswith(prefix):
                return self.on_this_stage("model." + name[len(prefix):])
        if name.startswith(("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                            "vision_tower.", "audio_tower.", "multi_modal_projector.")):
            return None  # multimodal towers: not used by the text model (under PP: first stage only)
        return self.on_this_stage(name)

    def on_this_stage(self, name: str) -> str | None:
        """Pipeline parallel: None for tensors another stage owns; the tied embedding also feeds the
        last stage's head. Everything this stage owns must then be found ("missing" is per stage)."""
        m = self.model
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            return self.merged_segment(name, m.layers[i]) if m.start_layer <= i < m.end_layer else None
        if name == "model.embed_tokens.weight" and self.cfg.tie_word_embeddings and m.is_last and not m.is_first:
            return "lm_head.weight"
        if name.startswith(("model.embed_tokens.", "model.embed_tokens_per_layer.", "model.per_layer_model_projection.",
                            "model.per_layer_projection_norm.")) and not m.is_first:
            return None
        if name.startswith(("model.norm.", "lm_head.")) and not m.is_last:
            return None
        return name

    _SEGMENTS = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
                 "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
                 "mlp.up_proj": ("mlp.gate_up_proj", 1)}

    @classmethod
    def merged_segment(cls, name: str, layer: nn.Module) -> str | tuple:
        """model.layers.N.self_attn.k_proj.weight -> (model.layers.N.self_attn.qkv_proj.weight, its rows of the
        merged weight); other names unchanged (a k_proj the layer does not have stays unexpected)."""
        prefix, _, rest = name.partition(".layers.")
        idx, _, tail = rest.partition(".")
        module, _, param = tail.rpartition(".")
        if module not in cls._SEGMENTS:
            return name
        merged, seg = cls._SEGMENTS[module]
        proj = layer.get_submodule(merged)
        if seg >= len(proj.sizes):
            return name
        return f"{prefix}.layers.{idx}.{merged}.{param}", proj.segment(seg)

    def skip_missing(self, name: str) -> bool:
        return False
