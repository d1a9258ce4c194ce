"""The floor of a shape: the least time any engine needs on this device.

Decode: every step reads the active weights (the experts a batch touches, expected under uniform
routing), and each sequence's KV cache; we divide those bytes by the measured copy bandwidth.
Prefill: its FLOPs over the measured matmul rate.

Two families: Gemma 4 (sliding/full attention) and Qwen3.5 (Gated DeltaNet linear attention plus gated full
attention, dense or MoE); the public functions dispatch on the config's model_type / architectures.
"""

from __future__ import annotations

import time

import torch


def measure_copy_bandwidth(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Bytes moved (read + write) per second by a large device-to-device copy."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t)


def measure_matmul_rate(device: str = "cuda", n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (time.perf_counter() - t)


def expected_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch's tokens touch in one MoE layer, expected if each token's k picks were uniform
    and independent (benchmarks/moe_routing.py counts them in an engine's own run)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def _layer_shapes(cfg: dict):
    n = cfg["num_hidden_layers"]
    for i in range(n):
        full = cfg["layer_types"][i] == "full_attention"
        hd = cfg.get("global_head_dim", cfg["head_dim"]) if full else cfg["head_dim"]
        kvh = cfg.get("num_global_key_value_heads") if (full and cfg.get("attention_k_eq_v")) else None
        kvh = kvh or cfg["num_key_value_heads"]
        yield full, hd, kvh, bool(full and cfg.get("attention_k_eq_v"))


def _gemma_decode_step_bytes(cfg: dict, batch: int, context: int, elt: int = 2) -> float:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    shared_from = cfg["num_hidden_layers"] - cfg.get("num_kv_shared_layers", 0)
    weights = cfg["vocab_size"] * h  # tied LM head
    kv = 0.0
    for i, (full, hd, kvh, keqv) in enumerate(_layer_shapes(cfg)):
        q_o = 2 * h * heads * hd
        kv_proj = 0 if i >= shared_from else h * kvh * hd * (1 if keqv else 2)
        weights += q_o + kv_proj + 3 * h * cfg["intermediate_size"]
        if cfg.get("hidden_size_per_layer_input"):
            weights += 2 * h * cfg["hidden_size_per_layer_input"]
        if cfg.get("enable_moe_block"):
            e, k, inter = cfg["num_experts"], cfg["top_k_experts"], cfg["moe_intermediate_size"]
            touched = expected_touched(e, k, batch)
            weights += touched * 3 * inter * h + h * e
        if i < shared_from:
            tokens = context if full else min(context, cfg["sliding_window"])
            kv += batch * tokens * kvh * hd * (1 if keqv else 2)
    return (weights + kv) * elt


def _gemma_prefill_flops(cfg: dict, batch: int, prompt: int) -> float:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    dense = 0.0
    attn = 0.0
    for full, hd, kvh, keqv in _layer_shapes(cfg):
        dense += 2 * h * heads * hd + h * kvh * hd * (1 if keqv else 2) + 3 * h * cfg["intermediate_size"]
        if cfg.get("enable_moe_block"):
            dense += cfg["top_k_experts"] * 3 * cfg["moe_intermediate_size"] * h
        span = prompt if full else min(prompt, cfg["sliding_window"])
        attn += 2 * 2 * heads * hd * prompt * span / (2 if full else 1)
    dense += cfg["vocab_size"] * h / prompt  # logits for the last token only
    return 2 * dense * batch * prompt + attn * batch


# Qwen3.5 ------------------------------------------------------------------------------------------------

# Chunk length of the chunked delta rule (ops/triton/delta_rule.py: CHUNK = 64).
DELTA_RULE_CHUNK = 64


def _is_qwen(cfg: dict) -> bool:
    text = cfg.get("text_config") or cfg
    archs = cfg.get("architectures") or []
    return str(text.get("model_type", "")).startswith("qwen3_5") or any(a.startswith("Qwen3_5") for a in archs)


def _qwen(cfg: dict):
    """The config as our engine reads it (defaults, nested text_config and layer pattern resolved)."""
    from compiled_llm.models.qwen3_5_config import Qwen3_5TextConfig

    text = cfg.get("text_config") or cfg
    kinds = [str(text.get("model_type", "")), str(cfg.get("model_type", ""))] + list(cfg.get("architectures") or [])
    moe = any("moe" in k.lower() for k in kinds) or bool(text.get("num_experts"))
    return Qwen3_5TextConfig.from_dict(text, top=cfg, moe=moe)


def _qwen_full_weights(c) -> int:
    """q_proj (query and output gate: 2x), k_proj, v_proj, o_proj."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return c.hidden_size * (2 * q + 2 * kv + q)


def _qwen_linear_dims(c) -> tuple[int, int, int]:
    key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    return key, value, 2 * key + value  # conv_dim: q, k, v go through the conv


def _qwen_linear_weights(c) -> int:
    """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj and the depthwise conv."""
    _, value, conv = _qwen_linear_dims(c)
    h = c.hidden_size
    return h * (conv + value + 2 * c.linear_num_value_heads) + value * h + conv * c.linear_conv_kernel_dim


def _qwen_mlp_weights(c, experts: float) -> float:
    """experts: routed experts counted (touched ones for decode, top-k per token for prefill)."""
    h = c.hidden_size
    if not c.is_moe:
        return 3 * h * c.intermediate_size
    shared = 3 * h * c.shared_expert_intermediate_size + h  # shared expert and its sigmoid gate
    return experts * 3 * c.moe_intermediate_size * h + h * c.num_experts + shared


def _qwen_state_bytes(c, elt: int) -> float:
    """One sequence, one linear layer: recurrent state (float32) and conv window, each read and written."""
    _, _, conv = _qwen_linear_dims(c)
    ssm = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return 2 * ssm + 2 * conv * (c.linear_conv_kernel_dim - 1) * elt


def _qwen_decode_step_bytes(cfg: dict, batch: int, context: int, elt: int = 2) -> float:
    c = _qwen(cfg)
    touched = expected_touched(c.num_experts, c.num_experts_per_tok, batch) if c.is_moe else 0
    weights = c.vocab_size * c.hidden_size  # untied LM head (tied: the same count)
    kv, state = 0.0, 0.0
    for kind in c.layer_types:
        weights += _qwen_mlp_weights(c, touched)
        if kind == "full_attention":
            weights += _qwen_full_weights(c)
            kv += batch * context * 2 * c.num_key_value_heads * c.head_dim
        else:
            weights += _qwen_linear_weights(c)
            state += batch * _qwen_state_bytes(c, elt)
    return (weights + kv) * elt + state


def _delta_rule_flops(c, tokens: int) -> float:
    """Chunked gated delta rule, per value head and token, in multiply-adds: 3 * Dk * Dv for the state
    products (q.S, k.S, the rank-update into S) plus DELTA_RULE_CHUNK * (3 * Dk + 2 * Dv) inside the chunk
    (q.k^T, k.k^T, attention x v, and the (I + L)^-1 products building w and u). About 5.5 x 2 * Dk * Dv
    at Dk = Dv = 128."""
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    per_head = 3 * dk * dv + DELTA_RULE_CHUNK * (3 * dk + 2 * dv)
    return 2 * tokens * c.linear_num_value_heads * per_head


def _qwen_prefill_flops(cfg: dict, batch: int, prompt: int) -> float:
    c = _qwen(cfg)
    dense, mixer = 0.0, 0.0
    for kind in c.layer_types:
        dense += _qwen_mlp_weights(c, c.num_experts_per_tok)
        if kind == "full_attention":
            dense += _qwen_full_weights(c)
            mixer += 2 * 2 * c.num_attention_heads * c.head_dim * prompt * prompt / 2  # causal QK^T and PV
        else:
            dense += _qwen_linear_weights(c)
            mixer += _delta_rule_flops(c, prompt)
    dense += c.vocab_size * c.hidden_size / prompt  # logits for the last token only
    return 2 * dense * batch * prompt + mixer * batch


# Dispatch ------------------------------------------------------------------------------------------------

def decode_step_bytes(cfg: dict, batch: int, context: int, elt: int = 2) -> float:
    """Bytes one decode step reads (and, for recurrent state, writes) at this batch and context."""
    fn = _qwen_decode_step_bytes if _is_qwen(cfg) else _gemma_decode_step_bytes
    return fn(cfg, batch, context, elt)


def prefill_flops(cfg: dict, batch: int, prompt: int) -> float:
    fn = _qwen_prefill_flops if _is_qwen(cfg) else _gemma_prefill_flops
    return fn(cfg, batch, prompt)


def floor_seconds(cfg: dict, prompt: int, batch: int, output: int, bandwidth: float, flops: float) -> float:
    t = prefill_flops(cfg, batch, prompt) / flops
    for step in range(output - 1):
        t += decode_step_bytes(cfg, batch, prompt + step + 1) / bandwidth
    return t
