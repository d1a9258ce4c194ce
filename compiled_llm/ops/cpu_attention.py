"""The CPU's paged cache kernels. The decode attention: one C++ kernel that reads each sequence's keys and values
where they lie in the cache, through its block table, and keeps a running softmax over them (no gathered copy, no
slot plan).

The reference provider gathers a decode batch's keys and values into a padded copy (1 MB a layer at 8 x 128
tokens of the host-overhead model) and runs SDPA on it, after a slot plan made a KV group a step: ~130 us a
layer in a CPU decode step on 2 cores. This kernel reads the cache once and writes only the output, vectorized
by hand through ATen's Vectorized<float> (the ISA Inductor builds for: AVX512, AVX2, else plain loops): VL keys'
scores summed at once by a transposing add, the exps a vector at a time, the value accumulators in registers.
~8 us a layer alone at 8 sequences x 100 keys on 2 cores (1 core: ~14 us; the scalar loops before it: 28-33 and
62-72 us in the same runs; inside the host-overhead model's steps, where a layer's keys and values come from
memory rather than cache, a median 27 us against 31). It is built once per process through Inductor's C++
toolchain (the compiler, OpenMP and ISA flags Inductor's own CPU kernels get; cached on disk like them), with
GCC's loop vectorizer on for its few plain loops (Inductor turns it off because its kernels vectorize by hand).

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
from compiled_llm.ops.context import layer_cache, step_memo

MAX_GROUP, MAX_HEAD_DIM = 16, 512  # the kernel's per-task accumulators: query heads a KV head, head_dim

SOURCE = r"""
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

constexpr int64_t MAX_GROUP = @MAX_GROUP@, MAX_HEAD_DIM = @MAX_HEAD_DIM@;  // (the Python constants)

// Vectorized<float>: the ISA Inductor built for (AVX512, AVX2, or plain loops on other CPUs)
using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size(), C = 128;  // floats a vector; keys a chunk
static_assert(C % VL == 0, "a chunk's score rows are whole vectors");

// out[0:VL] = the lane sums of p[0], ..., p[VL - 1], all at once: a transpose as it adds (~2 shuffles a sum,
// where one vector at a time takes log2(VL) shuffles and as many dependent adds)
static inline void vsum_all(const Vec* p, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)  // a 128-bit lane: [x 0+2, y 0+2, x 1+3, y 1+3] for x, y = p[2i], p[2i+1]
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // a 128-bit lane: that lane's sums of p[4i], ..., p[4i+3]
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)  // lanes 0+1 and 2+3 of b[2i], then of b[2i+1]
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                        _mm512_shuffle_f32x4(c[0], c[1], 0xDD)));
#elif defined(CPU_CAPABILITY_AVX2)
    __m256 a[4], b[2];
    for (int i = 0; i < 4; ++i)
        a[i] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
        const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
        b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                                        _mm256_permute2f128_ps(b[0], b[1], 0x31)));
#else
    for (int64_t i = 0; i < VL; ++i)
        out[i] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, p[i]);
#endif
}

// a . b, its lanes not yet summed. DC: D when built (a whole number of vectors: the loop unrolls), 0: any D
template <int64_t DC>
static inline Vec dot(const float* a, const float* b, int64_t D) {
    if constexpr (DC > 0) {
        Vec s = Vec::loadu(a) * Vec::loadu(b);
        for (int64_t d = VL; d < DC; d += VL) s = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), s);
        return s;
    } else {
        Vec s(0.f);
        for (int64_t d = 0; d < D; d += VL) {
            const int64_t r = std::min(VL, D - d);
            s = at::vec::fmadd(Vec::loadu(a + d, r), Vec::loadu(b + d, r), s);
        }
        return s;
    }
}

// acc[g][0 : 4 VL] += w[g][j] * v_j[0 : 4 VL] for GB query rows over the chunk's c keys: the accumulators stay in
// registers and each value row is loaded once for the GB rows
template <int GB>
static inline void pv_tile(const float* v, const int64_t* slot, int64_t c, int64_t row, const float* w, float* acc,
                           int64_t D) {
    Vec a[GB][4];
    for (int g = 0; g < GB; ++g)
        for (int t = 0; t < 4; ++t) a[g][t] = Vec::loadu(acc + g * D + t * VL);
    for (int64_t j = 0; j < c; ++j) {
        const float* vp = v + slot[j] * row;
        Vec x[4];
        for (int t = 0; t < 4; ++t) x[t] = Vec::loadu(vp + t * VL);
        for (int g = 0; g < GB; ++g) {
            const Vec wg(w[g * C + j]);
            for (int t = 0; t < 4; ++t) a[g][t] = at::vec::fmadd(wg, x[t], a[g][t]);
        }
    }
    for (int g = 0; g < GB; ++g)
        for (int t = 0; t < 4; ++t) a[g][t].store(acc + g * D + t * VL);
}

// One (sequence, KV head) task: q its G query rows, k and v its head's columns of the planes, table its block
// ids, out its G output rows. Its keys in the window go in chunks of C: VL keys' scores at a time for each query
// row, the running max and sum rescaled once a chunk, then the values.
template <int64_t DC>
static void task(const float* q, const float* k, const float* v, const int32_t* table, int64_t seq, float* out,
                 int64_t G, int64_t D, int64_t bs, int64_t row, int64_t window, float scale, float softcap) {
    constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
    float m[MAX_GROUP], l[MAX_GROUP], sc[MAX_GROUP * C], acc[MAX_GROUP * MAX_HEAD_DIM];
    int64_t slot[C];
    std::fill(m, m + G, NEG_INF);
    std::fill(l, l + G, 0.f);
    std::fill(acc, acc + G * D, 0.f);
    const int64_t n = window > 0 ? std::min(seq, window) : seq;
    const int64_t Dt = D - D % (4 * VL);  // the whole 4-vector tiles of a row
    for (int64_t p0 = seq - n; p0 < seq; p0 += C) {
        int64_t c = 0;
        const int64_t p1 = std::min(seq, p0 + C);
        for (int64_t p = p0, e; p < p1; p = e) {  // a block's run of positions at a time (one division)
            const int64_t i = p / bs, blk = table[i];
            e = std::min(p1, (i + 1) * bs);
            if (blk >= 0)
                for (int64_t s = blk * bs + p - i * bs, t = p; t < e; ++t) slot[c++] = s++;
        }
        if (c == 0) continue;
        const int64_t cp = (c + VL - 1) / VL * VL;  // whole vectors of keys: the padding reads the last key again
        std::fill(slot + c, slot + cp, slot[c - 1]);
        for (int64_t j0 = 0; j0 < cp; j0 += VL)
            for (int64_t g = 0; g < G; ++g) {
                Vec s[VL];
                for (int64_t j = 0; j < VL; ++j) s[j] = dot<DC>(q + g * D, k + slot[j0 + j] * row, D);
                vsum_all(s, sc + g * C + j0);
            }
        for (int64_t g = 0; g < G; ++g) {
            float* s = sc + g * C;
            for (int64_t j = 0; j < cp; j += VL) {
                Vec x = Vec::loadu(s + j) * Vec(scale);
                if (softcap > 0.f) x = (x / Vec(softcap)).tanh() * Vec(softcap);
                x.store(s + j);
            }
            std::fill(s + c, s + cp, NEG_INF);  // the padding's weights: 0
            Vec mv(m[g]);
            for (int64_t j = 0; j < cp; j += VL) mv = at::vec::maximum(mv, Vec::loadu(s + j));
            const float mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mv);
            if (mx > m[g]) {
                const float corr = std::exp(m[g] - mx);
                l[g] *= corr;
                for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= corr;
                m[g] = mx;
            }
            Vec lv(0.f);
            for (int64_t j = 0; j < cp; j += VL) {
                const Vec w = (Vec::loadu(s + j) - Vec(mx)).exp();
                w.store(s + j);
                lv = lv + w;
            }
            l[g] += at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, lv);
        }
        for (int64_t d0 = 0; d0 < Dt; d0 += 4 * VL) {
            int64_t g = 0;
            for (; g + 2 <= G; g += 2) pv_tile<2>(v + d0, slot, c, row, sc + g * C, acc + g * D + d0, D);
            if (g < G) pv_tile<1>(v + d0, slot, c, row, sc + g * C, acc + g * D + d0, D);
        }
        for (int64_t d = Dt; d < D; d += VL) {  // the vectors past the whole tiles, the last maybe partial
            const int64_t r = std::min(VL, D - d);
            for (int64_t g = 0; g < G; ++g) {
                Vec a = Vec::loadu(acc + g * D + d, r);
                for (int64_t j = 0; j < c; ++j)
                    a = at::vec::fmadd(Vec(sc[g * C + j]), Vec::loadu(v + slot[j] * row + d, r), a);
                a.store(acc + g * D + d, r);
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
    }
}

// q [B, H, D]; kv the cache: its key plane, then (plane floats on) its value plane, each [slots, KV, D] (row =
// KV * D floats a slot); tables [B, width] block ids (< 0:
// released); seq_lens [B]; out [B, H, D]. One task a (sequence, KV head); the common head dims built unrolled.
extern "C" void kernel(const float* q, const float* kv, const int32_t* tables, const int32_t* seq_lens, float* out,
                       int64_t B, int64_t H, int64_t KV, int64_t D, int64_t width, int64_t bs, int64_t row,
                       int64_t window, int64_t plane, float scale, float softcap) {
    const int64_t G = H / KV;
    const float *kc = kv, *vc = kv + plane;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < KV; ++h) {
            const int64_t i = (b * H + h * G) * D;
            auto run = [&](auto f) {
                f(q + i, kc + h * D, vc + h * D, tables + b * width, seq_lens[b], out + i, G, D, bs, row, window,
                  scale, softcap);
            };
            if (D == 64 && D % VL == 0) run(task<64>);
            else if (D == 128 && D % VL == 0) run(task<128>);
            else if (D == 256 && D % VL == 0) run(task<256>);
            else run(task<0>);
        }
    }
}
""".replace("@MAX_GROUP@", str(MAX_GROUP)).replace("@MAX_HEAD_DIM@", str(MAX_HEAD_DIM))

ARGTYPES = (["const float*"] * 2 + ["const int32_t*"] * 2 + ["float*"] + ["int64_t"] * 9 + ["float"] * 2)


@functools.lru_cache(maxsize=None)
def kernel():
    """The built kernel (a Python callable on tensors and numbers), once per process."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(ARGTYPES, SOURCE, extra_flags=("-ftree-loop-vectorize",))


WRITE_SOURCE = r"""
#include <cstdint>
#include <cstring>

// k, v [n, row] with row strides in bytes; slots [n] (< 0: padding, skipped); kv the cache: its key plane, then
// (plane bytes on) its value plane, each [slots, row] contiguous
extern "C" void kernel(const char* k, const char* v, const int64_t* slots, char* kv, int64_t n, int64_t row_bytes,
                       int64_t k_stride, int64_t v_stride, int64_t plane) {
    char *kc = kv, *vc = kv + plane;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        std::memcpy(kc + s * row_bytes, k + i * k_stride, row_bytes);
        std::memcpy(vc + s * row_bytes, v + i * v_stride, row_bytes);
    }
}
"""

WRITE_ARGTYPES = ["const char*", "const char*", "const int64_t*", "char*"] + ["int64_t"] * 5


@functools.lru_cache(maxsize=None)
def write_kernel():
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(WRITE_ARGTYPES, WRITE_SOURCE)


def build_error(build) -> str | None:
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
    return build_error(write_kernel)


def _two_planes(cache: torch.Tensor) -> bool:
    """Whether the kernels take the cache: contiguous key and value planes, passed as the cache and the second
    plane's offset (a view of each plane cost ~2 us of Python a layer call)."""
    return cache.shape[0] == 2 and cache.is_contiguous()


def kv_cache_write(k: torch.Tensor | None, v: torch.Tensor, layer_idx: int) -> None:
    """This step's keys and values into their slots; K=V layers (k None) and row layouts the loop does not take
    through the reference write."""
    ctx, spec, cache, group = layer_cache(layer_idx)
    slots = group.slot_mapping
    n = slots.shape[0]
    row = spec.num_kv_heads * spec.head_dim
    if (k is None or spec.k_eq_v or spec.rot_keys or not _two_planes(cache)
            or k.dtype != cache.dtype or v.dtype != cache.dtype or k.dim() != 2 or v.dim() != 2
            or k.shape[0] < n or v.shape[0] < n or k.shape[1] != row or v.shape[1] != row
            or k.stride(1) != 1 or v.stride(1) != 1 or slots.dtype != torch.int64 or not slots.is_contiguous()):
        return ref_kv_cache_write(k, v, layer_idx)
    size = cache.element_size()
    write_kernel()(k, v, slots, cache, n, row * size, k.stride(0) * size, v.stride(0) * size, cache.stride(0) * size)


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
    return build_error(kernel)


def _decode_plan(ctx, group):
    """The step's int32 lengths and the group's int32 block tables (empty: not a decode batch), once a step (made
    again per layer call, they cost ~10 us of Python a call on 2 cores)."""
    def make():
        if not decode_batch(ctx):
            return ()
        meta = ctx.attn_metadata
        lens = meta.seq_lens_tensor  # the runner's, int32 (a step built elsewhere: made here)
        lens = torch.tensor(meta.seq_lens, dtype=torch.int32) if lens is None else lens.to(torch.int32)
        return lens, group.block_tables.to(torch.int32).contiguous()

    return step_memo(ctx, ("_cpu_decode_plan", id(group)), make)


def attention(q: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Decode batches through the kernel; any other step (prompt rows, media spans) through the reference."""
    ctx, spec, cache, group = layer_cache(layer_idx)
    plan = _decode_plan(ctx, group)
    if not plan or cache.dtype != torch.float32 or q.dtype != torch.float32 or not _two_planes(cache):
        return ref_attention(q, layer_idx)
    lens, tables = plan
    meta = ctx.attn_metadata
    num_seqs = len(meta.seq_lens)
    out = (torch.empty if q.shape[0] == num_seqs else torch.zeros)(q.shape[0], spec.num_heads * spec.head_dim)
    kernel()(q.contiguous(), cache, tables, lens, out, num_seqs, spec.num_heads, spec.num_kv_heads, spec.head_dim,
             tables.shape[1], meta.block_size, spec.num_kv_heads * spec.head_dim, spec.sliding_window or 0,
             cache.stride(0), spec.scale, spec.softcap or 0.0)
    return out
