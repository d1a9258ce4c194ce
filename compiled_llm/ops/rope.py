"""Rotary position embeddings as Gemma 4 and most Hugging Face models apply them (rotate-half layout)."""

from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, theta: float, rope_type: str = "default", partial_rotary_factor: float = 1.0,
                  factor: float = 1.0) -> torch.Tensor:
    """Inverse frequencies, head_dim // 2 of them. 'proportional' rotates only the first
    partial_rotary_factor share of the angles and leaves the rest at zero frequency (identity)."""
    if rope_type == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope_type == "proportional":
        angles = rotated_pairs(head_dim, rope_type, partial_rotary_factor)
        rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / head_dim))
        inv = torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float)])
        return inv / factor
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, proportional)")


def rotated_pairs(head_dim: int, rope_type: str = "default", partial_rotary_factor: float = 1.0) -> int:
    """How many of rope_inv_freq's angles are nonzero; they come first, the rest leave their dims as they are
    (a K=V layer's decode rebuilds keys for the rotated dims only)."""
    if rope_type == "proportional":
        return int(partial_rotary_factor * head_dim // 2)
    return head_dim // 2


def rotated_block(rotated_pairs: int | None, half: int) -> int:
    """The rotated dims of each half that a K=V layer's keys need rebuilt (or cached: AttentionSpec.rot_keys), as a
    power of two >= 16 (a dot's minimum; the angles between rotated_pairs and it are zero, so those keys are
    exact too), or half when that is not smaller (every dim rotates)."""
    if rotated_pairs is None:
        return half
    rot = 16
    while rot < rotated_pairs:
        rot *= 2
    return rot if rot < half else half


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None].float() * inv_freq.to(positions.device, torch.float)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]."""
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
