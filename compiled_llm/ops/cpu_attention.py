"""The CPU's paged cache kernels. The decode attention: one C++ kernel that reads each sequence's keys and values
where they lie in the cache, through its block table, and keeps a running softmax over them (no gathered copy, no
slot plan).

The reference provider gathers a decode batch's keys and values into a padded copy (1 MB a layer at 8 x 128
tokens of the host-overhead model) and runs SDPA on it, after a slot plan made a KV group a step: ~130 us a
layer in a CPU decode step on 2 cores. This kernel reads the cache once and writes only the output (~35 us a
layer alone; benchmarks/NOTES.md, 2026-12-05 session 43). It is built once per process through Inductor's C++
toolchain (the compiler, OpenMP and ISA flags Inductor's own CPU kernels get; cached on disk like them), with
GCC's loop vectorizer on (Inductor turns it off because its kernels vectorize by hand).

Decode batches only (one query a sequence), float32 caches whose rows hold plain keys and values: prompt rows,
K=V layers (keys rebuilt from the values) and other dtypes go to the reference, which the resolver says.

The KV write: a C++ loop that copies each new token's key and value rows into their slots (slots < 0 are padding),
in place of the reference's reshapes, dtype checks and two `index_copy_` calls (~14 us of Python and dispatch a
layer on 2 cores, 4-7% of the host-overhead model's run). Any dtype (rows are copied as bytes); a K=V layer (its
rows keep rotated keys: ops/attention.py write_kv) goes to the reference write, as before this kernel.
"""

from __future__ import annotations

import functools

import torch

from compiled_llm.ops.attention import decode_batch, ref_attention, ref_kv_cache_write
from compiled_llm.ops.context import layer_cache

MAX_GROUP, MAX_HEAD_DIM = 16, 512  # the kernel's per-task accumulators: query heads a KV head, head_dim

SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

constexpr int64_t MAX_GROUP = @MAX_GROUP@, MAX_HEAD_DIM = @MAX_HEAD_DIM@;  // (the Python constants)

// q [B, H, D]; k and v planes [slots, KV, D] (row = KV * D floats a slot); tables [B, width] block ids (< 0:
// released); seq_lens [B]; out [B, H, D]. Each (sequence, KV head) task walks the sequence's keys in its window
// in chunks of C: scores for the chunk, the running max and sum rescaled once a chunk, then the values.
extern "C" void kernel(const float* q, const float* kc, const float* vc, const int32_t* tables,
                       const int32_t* seq_lens, float* out, int64_t B, int64_t H, int64_t KV, int64_t D,
                       int64_t width, int64_t bs, int64_t row, int64_t window, float scale, float softcap) {
    const int64_t G = H / KV;
    constexpr int64_t C = 128;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < KV; ++h) {
            float m[MAX_GROUP], l[MAX_GROUP], sc[MAX_GROUP * C], acc[MAX_GROUP * MAX_HEAD_DIM];
            int64_t slot[C];
            for (int64_t g = 0; g < G; ++g) {
                m[g] = -std::numeric_limits<float>::infinity();
                l[g] = 0.f;
            }
            for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
            const int64_t seq = seq_lens[b];
            const int64_t n = window > 0 ? std::min(seq, window) : seq;
            const float* qs = q + (b * H + h * G) * D;
            for (int64_t p0 = seq - n; p0 < seq; p0 += C) {
                int64_t c = 0;
                for (int64_t p = p0; p < std::min(seq, p0 + C); ++p) {
                    const int64_t blk = tables[b * width + p / bs];
                    if (blk >= 0) slot[c++] = blk * bs + p % bs;
                }
                for (int64_t j = 0; j < c; ++j) {
                    const float* kp = kc + slot[j] * row + h * D;
                    for (int64_t g = 0; g < G; ++g) {
                        const float* qg = qs + g * D;
                        float dot = 0.f;
                        #pragma omp simd reduction(+:dot)
                        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kp[d];
                        float x = dot * scale;
                        if (softcap > 0.f) x = std::tanh(x / softcap) * softcap;
                        sc[g * C + j] = x;
                    }
                }
                for (int64_t g = 0; g < G; ++g) {
                    float mx = m[g];
                    for (int64_t j = 0; j < c; ++j) mx = std::max(mx, sc[g * C + j]);
                    if (mx > m[g]) {
                        const float corr = std::exp(m[g] - mx);
                        l[g] *= corr;
                        float* a = acc + g * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; ++d) a[d] *= corr;
                        m[g] = mx;
                    }
                    for (int64_t j = 0; j < c; ++j) {
                        const float w = std::exp(sc[g * C + j] - mx);
                        sc[g * C + j] = w;
                        l[g] += w;
                    }
                }
                for (int64_t j = 0; j < c; ++j) {
                    const float* vp = vc + slot[j] * row + h * D;
                    for (int64_t g = 0; g < G; ++g) {
                        const float w = sc[g * C + j];
                        float* a = acc + g * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; ++d) a[d] += w * vp[d];
                    }
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                float* o = out + (b * H + h * G + g) * D;
                const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
                for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
            }
        }
    }
}
""".replace("@MAX_GROUP@", str(MAX_GROUP)).replace("@MAX_HEAD_DIM@", str(MAX_HEAD_DIM))

ARGTYPES = (["const float*"] * 3 + ["const int32_t*"] * 2 + ["float*"] + ["int64_t"] * 8 + ["float"] * 2)


@functools.lru_cache(maxsize=None)
def kernel():
    """The built kernel (a Python callable on tensors and numbers), once per process."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(ARGTYPES, SOURCE, extra_flags=("-ftree-loop-vectorize",))


WRITE_SOURCE = r"""
#include <cstdint>
#include <cstring>

// k, v [n, row] with row strides in bytes; slots [n] (< 0: padding, skipped); kc, vc the cache's key and value
// planes, [slots, row] contiguous
extern "C" void kernel(const char* k, const char* v, const int64_t* slots, char* kc, char* vc, int64_t n,
                       int64_t row_bytes, int64_t k_stride, int64_t v_stride) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        std::memcpy(kc + s * row_bytes, k + i * k_stride, row_bytes);
        std::memcpy(vc + s * row_bytes, v + i * v_stride, row_bytes);
    }
}
"""

WRITE_ARGTYPES = ["const char*", "const char*", "const int64_t*", "char*", "char*"] + ["int64_t"] * 4


@functools.lru_cache(maxsize=None)
def write_kernel():
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(WRITE_ARGTYPES, WRITE_SOURCE)


def _build_error(build) -> str | None:
    """Why a kernel's build failed (None: it built). No C++ compiler Inductor can use: the reference serves, and
    the provider table says why."""
    try:
        build()
    except Exception as e:
        return f"the C++ kernel did not build ({type(e).__name__}: {e})"
    return None


def write_unsupported(caps, shape: dict) -> str | None:
    """Why the C++ KV write cannot serve this engine (None: it can)."""
    if caps.device_type != "cpu":
        return "the C++ KV write serves CPU engines"
    return _build_error(write_kernel)


def kv_cache_write(k: torch.Tensor | None, v: torch.Tensor, layer_idx: int) -> None:
    """This step's keys and values into their slots; K=V layers (k None) and row layouts the loop does not take
    through the reference write."""
    ctx, spec, cache, group = layer_cache(layer_idx)
    slots = group.slot_mapping
    n = slots.shape[0]
    row = spec.num_kv_heads * spec.head_dim
    if (k is None or spec.k_eq_v or spec.rot_keys or not cache.is_contiguous() or cache.shape[0] != 2
            or k.dtype != cache.dtype or v.dtype != cache.dtype or k.dim() != 2 or v.dim() != 2
            or k.shape[0] < n or v.shape[0] < n or k.shape[1] != row or v.shape[1] != row
            or k.stride(1) != 1 or v.stride(1) != 1 or slots.dtype != torch.int64 or not slots.is_contiguous()):
        return ref_kv_cache_write(k, v, layer_idx)
    size = cache.element_size()
    write_kernel()(k, v, slots, cache[0], cache[1], n, row * size, k.stride(0) * size, v.stride(0) * size)


def unsupported(caps, shape: dict) -> str | None:
    """Why the kernel cannot serve this layer (None: it can)."""
    if caps.device_type != "cpu":
        return "the C++ decode kernel serves CPU engines"
    layer, source = shape["layer"], shape.get("source", shape["layer"])
    if shape.get("dtype", torch.float32) != torch.float32:
        return f"{shape.get('dtype')}: the C++ decode kernel reads float32 caches"
    if source.k_eq_v or source.rot_keys:
        return "K=V cache (keys rebuilt from the values): the reference rebuilds them"
    if layer.num_heads % layer.num_kv_heads or layer.num_heads // layer.num_kv_heads > MAX_GROUP:
        return f"{layer.num_heads // layer.num_kv_heads} query heads a KV head: the kernel takes up to {MAX_GROUP}"
    if layer.head_dim > MAX_HEAD_DIM:
        return f"head_dim {layer.head_dim}: the kernel takes up to {MAX_HEAD_DIM}"
    return _build_error(kernel)


def attention(q: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Decode batches through the kernel; any other step (prompt rows, media spans) through the reference."""
    ctx, spec, cache, group = layer_cache(layer_idx)
    if not decode_batch(ctx) or q.dtype != torch.float32 or cache.dtype != torch.float32 or not cache.is_contiguous():
        return ref_attention(q, layer_idx)
    meta = ctx.attn_metadata
    num_seqs = len(meta.seq_lens)
    lens = meta.seq_lens_tensor  # the runner's, int32 (a step built elsewhere: made here)
    lens = torch.tensor(meta.seq_lens, dtype=torch.int32) if lens is None else lens.to(torch.int32)
    tables = group.block_tables.to(torch.int32).contiguous()
    out = (torch.empty if q.shape[0] == num_seqs else torch.zeros)(q.shape[0], spec.num_heads * spec.head_dim)
    kernel()(q.contiguous(), cache[0], cache[1], tables, lens, out, num_seqs, spec.num_heads, spec.num_kv_heads,
             spec.head_dim, tables.shape[1], meta.block_size, spec.num_kv_heads * spec.head_dim,
             spec.sliding_window or 0, spec.scale, spec.softcap or 0.0)
    return out
