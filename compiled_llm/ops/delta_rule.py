"""Gated delta rule (Gated DeltaNet linear attention) with a per-sequence recurrent state. Plain PyTorch reference.

Per head, with state S [Dk, Dv], for each token t:
    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t
q and k are L2-normalised and q scaled by Dk^-0.5 first; the state is kept in float32.
Prefill uses the chunked form (a unit-lower-triangular solve per chunk, then one state update per chunk);
decode steps the recurrence once for all single-token sequences of a batch.

The op takes the layer's short conv, gating inputs and output norm with it (Qwen3.5's Gated DeltaNet): q, k
and v are silu(causal conv) of in_proj's [q; k; v] columns (the causal_conv1d op, ops/conv1d.py, with its
per-sequence window), the log decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) come from the
[b; a] columns of in_proj, and the output gets the gated RMSNorm weight * o / rms(o) * silu(z) per value head.
Inside the op the GPU kernels compute the gating and the norm in the recurrence's own launch, and at decode the
conv too (three small launches a layer fewer at decode, and two graph pieces fewer: the ops split the graph, so
no such expression could join a neighbouring Inductor kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_llm.ops.conv1d import CAUSAL_CONV1D
from compiled_llm.ops.registry import OpSpec, Provider, custom_op, register
from compiled_llm.ops.state import StateLayout, get_state_metadata


def decay_and_beta(ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's log decay g = -exp(A_log) * softplus(a + dt_bias) (float32) and beta = sigmoid(b) (in the
    model's dtype, as a float32 view) from the [b; a] columns of in_proj ([tokens, 2 Hv])."""
    hv = a_log.shape[0]
    zeros = torch.zeros_like(a_log, dtype=torch.float32)
    shift = torch.cat([zeros, dt_bias.float()])
    scale = torch.cat([zeros, -a_log.float().exp()])
    is_b = torch.arange(2 * hv, device=ba.device) < hv
    out = torch.where(is_b, torch.sigmoid(ba).float(), scale * F.softplus(ba.float() + shift))
    return out[:, hv:], out[:, :hv]


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) * silu(gate) over the last dim, rounded as the model's module rounds: the normalised x
    to x's dtype, weight * x in their common dtype, the product with silu(gate) (float32) back to x's dtype."""
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * h * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., Hk, Dk] -> float32, normalised, scaled q, each k head repeated for its Hv // Hk value heads."""
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    rep = num_v_heads // q.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k


def recurrent_delta_rule(q, k, v, g, beta, state):
    """Token by token. q, k: [B, T, H, Dk] (prepared); v: [B, T, H, Dv]; g, beta: [B, T, H];
    state: [B, H, Dk, Dv] float32. Returns o [B, T, H, Dv] float32 and the final state."""
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float()
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        pred = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = (v[:, t] - pred) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return torch.stack(outs, dim=1), s


def chunk_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64):
    """Same contract as recurrent_delta_rule, computed chunk by chunk.

    Within a chunk with cumulative log decay c_t, the corrections d_t = beta_t (v_t - S_{t-1}'^T k_t) solve
    (I + L) d = beta V - (beta exp(c) K) S0 with L[i, j] = beta_i exp(c_i - c_j) k_i.k_j (j < i), so
    d = U - W S0; outputs are exp(c_t) q_t S0 + sum_{s<=t} exp(c_t - c_s) (q_t.k_s) d_s."""
    b, t_len, h, dk = q.shape
    v, g, beta = v.float(), g.float(), beta.float()
    pad = (-t_len) % chunk_size
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t_len + pad) // chunk_size

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.reshape(b, n, chunk_size, h, *x.shape[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    c = g.cumsum(dim=-1)  # [B, H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, N, C, C]
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay  # unit diagonal implied by the solve
    strict = system.masked_fill(~causal.tril(-1), 0.0)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v * beta[..., None], kb * c.exp()[..., None]], dim=-1)
    sol = torch.linalg.solve_triangular(eye + strict, rhs, upper=False, unitriangular=True)
    u, w = sol[..., :v.shape[-1]], sol[..., v.shape[-1]:]
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * c.exp()[..., None]
    k_dec = k * (c[..., -1:] - c).exp()[..., None]
    s = state.float()
    outs = []
    for i in range(n):
        d = u[:, :, i] - w[:, :, i] @ s
        outs.append(q_dec[:, :, i] @ s + intra[:, :, i] @ d)
        s = s * c[:, :, i, -1].exp()[..., None, None] + k_dec[:, :, i].transpose(-1, -2) @ d
    o = torch.stack(outs, dim=2)  # [B, H, N, C, Dv]
    o = o.permute(0, 2, 3, 1, 4).reshape(b, n * chunk_size, h, -1)[:, :t_len]
    return o, s


def gated_delta_rule_with_state(q, k, v, g, beta, cache: torch.Tensor, layout: StateLayout) -> torch.Tensor:
    """Flat tokens of a batch. q, k: [n, Hk, Dk]; v: [n, Hv, Dv]; g, beta: [n, Hv];
    cache: [num_slots, Hv, Dk, Dv] read and updated in place. Returns o [n, Hv, Dv] in v's dtype."""
    hv = v.shape[1]
    qp, kp = prepare_qk(q, k, hv)
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)  # rows past the last sequence stay zero
    single, batched = layout.single_rows()
    if batched:  # decode tokens, batched
        rows, slot_t, keep = batched
        state = torch.where(keep[:, None, None, None], cache.index_select(0, slot_t).float(), 0.0)
        pick = lambda x: x.index_select(0, rows)[:, None]  # noqa: E731
        o, new = recurrent_delta_rule(pick(qp), pick(kp), pick(v), pick(g), pick(beta), state)
        out.index_copy_(0, rows, o[:, 0])
        cache.index_copy_(0, slot_t, new.to(cache.dtype))
    for slot, start, end, carries in layout.prefill_spans(single):
        state = cache[slot].float()[None] if carries else v.new_zeros((1, *cache.shape[1:]), dtype=torch.float32)
        sl = slice(start, end)
        o, new = chunk_delta_rule(qp[None, sl], kp[None, sl], v[None, sl], g[None, sl], beta[None, sl], state)
        out[sl] = o[0]
        cache[slot] = new[0].to(cache.dtype)
    return out.to(v.dtype)


def split_qkv(mixed: torch.Tensor, num_k_heads: int, num_v_heads: int,
              v_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The [q; k; v] columns of mixed [tokens, channels] (any row stride) as head views q, k [tokens, Hk, Dk] and
    v [tokens, Hv, Dv] (Dk from the channel count: 2 Hk Dk + Hv Dv)."""
    n, channels = mixed.shape
    dk = (channels - num_v_heads * v_dim) // (2 * num_k_heads)
    kd, off, row = num_k_heads * dk, mixed.storage_offset(), mixed.stride(0)
    assert mixed.stride(1) == 1 and 2 * kd + num_v_heads * v_dim == channels, (mixed.shape, mixed.stride())
    q = mixed.as_strided((n, num_k_heads, dk), (row, dk, 1), off)
    k = mixed.as_strided((n, num_k_heads, dk), (row, dk, 1), off + kd)
    v = mixed.as_strided((n, num_v_heads, v_dim), (row, v_dim, 1), off + 2 * kd)
    return q, k, v


def ref_gated_delta_rule(qkv, conv_weight, ba, a_log, dt_bias, z, norm_weight, eps: float, num_k_heads: int,
                         layer_idx: int) -> torch.Tensor:
    """The reference recurrence, after the conv op's chosen provider (its reference on the CPU)."""
    meta = get_state_metadata()
    q, k, v = split_qkv(CAUSAL_CONV1D.impl()(qkv, conv_weight, layer_idx), num_k_heads, z.shape[1], z.shape[2])
    g, beta = decay_and_beta(ba, a_log, dt_bias)
    o = gated_delta_rule_with_state(q, k, v, g, beta, meta.caches[layer_idx]["ssm"], meta.layout)
    return gated_rms_norm(o, z, norm_weight, eps)


GATED_DELTA_RULE = register(OpSpec(
    "gated_delta_rule", "Gated DeltaNet linear attention with per-sequence state (short conv, gating and gated "
    "output norm inside): chunked prefill, recurrent decode", [
        Provider("triton", "compiled_llm.ops.triton.delta_rule:gated_delta_rule", lambda caps, shape: caps.triton_ok(),
                 capturable=True),
        Provider("reference", "compiled_llm.ops.delta_rule:ref_gated_delta_rule"),
    ], splits_graph=True, recurrent_state=True))


@custom_op("compiled_llm::gated_delta_rule", mutates_args=())
def gated_delta_rule_op(qkv: torch.Tensor, conv_weight: torch.Tensor, ba: torch.Tensor, a_log: torch.Tensor,
                        dt_bias: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        num_k_heads: int, layer_idx: int) -> torch.Tensor:
    return GATED_DELTA_RULE.impl()(qkv, conv_weight, ba, a_log, dt_bias, z, norm_weight, eps, num_k_heads, layer_idx)


@gated_delta_rule_op.register_fake
def _(qkv, conv_weight, ba, a_log, dt_bias, z, norm_weight, eps, num_k_heads, layer_idx):
    return torch.empty_like(z)


def gated_delta_rule(qkv, conv_weight, ba, a_log, dt_bias, z, norm_weight, eps: float, num_k_heads: int,
                     layer_idx: int) -> torch.Tensor:
    """One Gated DeltaNet layer from in_proj's columns to its normed output: q, k, v = silu(causal conv(qkv))
    split into heads, the delta rule with its gating, the gated output norm.
    qkv: [tokens, 2 Hk Dk + Hv Dv] (any row stride: a view of in_proj's output); conv_weight: [channels, K];
    z: [tokens, Hv, Dv]; ba: [tokens, 2 Hv] ([b; a] columns); a_log, dt_bias: [Hv]; norm_weight: [Dv].
    Returns gated_rms_norm(o, z) of the delta rule's output o, [tokens, Hv, Dv] in z's dtype.
    Uses and updates the layer's "conv" and "ssm" states in the forward context."""
    return torch.ops.compiled_llm.gated_delta_rule(qkv, conv_weight, ba, a_log, dt_bias, z, norm_weight, eps,
                                                   num_k_heads, layer_idx)
