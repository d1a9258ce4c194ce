"""Multimodal rotary embedding (M-RoPE) with partial rotation, as Qwen3-VL / Qwen3.5 apply it.

Positions are [3, tokens] (temporal, height, width) or [tokens] when all three agree (text-only).
Each rotary frequency takes its angle from one of the three components: interleaved layout
(Qwen3-VL, Qwen3.5) gives frequency f to height if f % 3 == 1 and f < 3 * section[1], to width if
f % 3 == 2 and f < 3 * section[2], else to time; the older contiguous layout (Qwen2-VL) gives the first
section[0] frequencies to time, the next section[1] to height, the rest to width. Only the first
rotary_dim = 2 * len(inv_freq) channels of each head rotate (rotate-half layout); the rest pass through.
"""

from __future__ import annotations

import torch


def rotary_inv_freq(head_dim: int, theta: float, partial_rotary_factor: float = 1.0) -> torch.Tensor:
    dim = int(head_dim * partial_rotary_factor)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def mrope_owner(num_freqs: int, section: list[int], interleaved: bool = True) -> torch.Tensor:
    """Which position component (0 t, 1 h, 2 w) drives each frequency."""
    if sum(section) != num_freqs or len(section) != 3:
        raise ValueError(f"mrope_section {section} must have 3 entries summing to {num_freqs} (rotary_dim / 2)")
    if not interleaved:
        return torch.tensor([0] * section[0] + [1] * section[1] + [2] * section[2])
    owner = torch.zeros(num_freqs, dtype=torch.long)
    owner[1:3 * section[1]:3] = 1
    owner[2:3 * section[2]:3] = 2
    return owner


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, owner: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [tokens, rotary_dim] for positions [tokens] or [3, tokens]."""
    inv = inv_freq.to(positions.device, torch.float)
    if positions.dim() == 1:
        freqs = positions[:, None].float() * inv[None, :]
    else:
        pos = positions.index_select(0, owner.to(positions.device))  # [freqs, tokens]: each frequency's component
        freqs = pos.t().float() * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + turned * sin[:, None, :]
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def apply_mrope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; both rotated with one cos/sin table."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
