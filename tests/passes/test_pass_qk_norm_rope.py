"""QK-norm + RoPE (+ KV write): the query path the models write (per-head RMSNorm, rotate-half RoPE) fuses
into qk_norm_rope_kv_write; RoPEs that rotate other pairs of dimensions are left alone. (The q, k, v
variants with the cache write run in the compiled model tests: they need a forward context.)"""

from __future__ import annotations

import pytest
import torch

from compiled_llm.ops.norm import ref_rms_norm
from compiled_llm.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from pass_utils import fuse, inspect

PASSES = ("qk_norm_rope_kv_write",)
HEAD_DIM = 16


def q_path(q, positions, inv_freq, weight):
    return apply_rope(ref_rms_norm(q, weight, 1e-6), positions, inv_freq)


def rope_cut_at(cut: int):
    """A RoPE of the same graph shape that rotates at `cut` instead of head_dim / 2."""

    def fn(q, positions, inv_freq, weight):
        x = ref_rms_norm(q, weight, 1e-6)
        cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        rotated = torch.cat([-x[..., cut:], x[..., :cut]], dim=-1)
        return x * cos + rotated * sin

    return fn


def interleaved(q, positions, inv_freq, weight):  # GPT-J style: pairs (2i, 2i+1)
    x = ref_rms_norm(q, weight, 1e-6)
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    return x * cos + rotated * sin


def inputs(n=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, 4, HEAD_DIM, generator=g).to(dtype), torch.arange(n) + 3,
            rope_inv_freq(HEAD_DIM, 10000.0), (1 + 0.3 * torch.randn(HEAD_DIM, generator=g)).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_then_rope_fuses_and_computes_the_same(dtype):
    args = inputs(dtype=dtype)
    matches, out = fuse(q_path, args, PASSES)
    assert matches["qk_norm_rope_kv_write"] == 1
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, q_path(*args), atol=tol, rtol=tol)


@pytest.mark.parametrize("fn", [rope_cut_at(HEAD_DIM // 4), interleaved], ids=["cut_at_quarter", "interleaved"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_other_ropes_are_left_alone(fn, device):
    assert inspect(fn, lambda: inputs(), PASSES, device=device)["qk_norm_rope_kv_write"] == 0
    assert inspect(rope_cut_at(HEAD_DIM // 2), lambda: inputs(), PASSES, device=device)["qk_norm_rope_kv_write"] == 1


def test_a_rope_cut_elsewhere_keeps_its_own_result():
    args, fn = inputs(), rope_cut_at(HEAD_DIM // 4)
    matches, out = fuse(fn, args, PASSES)
    assert matches["qk_norm_rope_kv_write"] == 0
    torch.testing.assert_close(out, fn(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_static_graph_fuses(dtype):
    assert inspect(q_path, lambda: inputs(n=1, dtype=dtype), PASSES, dtype=dtype, dynamic=False)[
        "qk_norm_rope_kv_write"] == 1


def inverse_rotation(q, positions, inv_freq, weight):
    """cat([-x1, x2]) instead of cat([-x2, x1]): the same slices at the same bounds, the other rotation."""
    x = ref_rms_norm(q, weight, 1e-6)
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., :half], x[..., half:]], dim=-1) * sin


def test_the_inverse_rotation_is_left_alone():
    """Its slices cut where RoPE's do (0, half, end), so a check of the bounds alone passed it (and the fused op
    would have rotated the other way); the check reads which slice is negated."""
    assert inspect(inverse_rotation, lambda: inputs(), PASSES)["qk_norm_rope_kv_write"] == 0
