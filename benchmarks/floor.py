"""The floor of a shape: the least time any engine needs on this device.

Decode: every step reads the active weights (the experts a batch touches, expected under uniform
routing), and each sequence's KV cache; we divide those bytes by the measured copy bandwidth.
Prefill: its FLOPs over the measured matmul rate.
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


def _layer_shapes(cfg: dict):
    n = cfg["num_hidden_layers"]
    for i in range(n):
        full = cfg["layer_types"][i] == "full_attention"
        hd = cfg.get("global_head_dim", cfg["head_dim"]) if full else cfg["head_dim"]
        kvh = cfg.get("num_global_key_value_heads") if (full and cfg.get("attention_k_eq_v")) else None
        kvh = kvh or cfg["num_key_value_heads"]
        yield full, hd, kvh, bool(full and cfg.get("attention_k_eq_v"))


def decode_step_bytes(cfg: dict, batch: int, context: int, elt: int = 2) -> float:
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
            touched = e * (1 - (1 - k / e) ** batch)
            weights += touched * 3 * inter * h + h * e
        if i < shared_from:
            tokens = context if full else min(context, cfg["sliding_window"])
            kv += batch * tokens * kvh * hd * (1 if keqv else 2)
    return (weights + kv) * elt


def prefill_flops(cfg: dict, batch: int, prompt: int) -> float:
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


def floor_seconds(cfg: dict, prompt: int, batch: int, output: int, bandwidth: float, flops: float) -> float:
    t = prefill_flops(cfg, batch, prompt) / flops
    for step in range(output - 1):
        t += decode_step_bytes(cfg, batch, prompt + step + 1) / bandwidth
    return t
