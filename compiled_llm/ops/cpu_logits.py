"""The CPU's greedy argmax: one C++ kernel over a decode batch's float32 logits.

torch.argmax over the host-overhead model's 8 x 8,192 logits took 70-85 us on 2 cores (a scalar reduction that
carries an index per element: ~10 ns an element on one thread), 1.5-2% of that model's decode step. This kernel
finds each row's maximum with vector maximums (NaN-propagating, as torch orders NaN above every number), then the
first index that holds it with vector compares: a few us. Built once per process through Inductor's C++ toolchain,
as ops/cpu_attention.py's kernels are; at::vec picks the host's vector width (scalar where there is none).
"""

from __future__ import annotations

import functools

import torch

SOURCE = r"""
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <cstdint>
#include <limits>

// x [rows, cols] (row stride `stride`), cols >= 1; out [rows] int64: the first index of the row's maximum, the
// first NaN where there is one (torch.argmax's order)
extern "C" void kernel(const float* x, int64_t* out, int64_t rows, int64_t cols, int64_t stride) {
    using V = at::vec::Vectorized<float>;
    constexpr int64_t W = V::size();
    // a decode batch's rows on one thread: below ~1M elements the fork costs more than it saves
    #pragma omp parallel for schedule(static) if (rows > 1 && rows * cols >= (1 << 20))
    for (int64_t r = 0; r < rows; ++r) {
        const float* p = x + r * stride;
        V vm(-std::numeric_limits<float>::infinity());
        int64_t i = 0;
        for (; i + W <= cols; i += W) vm = at::vec::maximum(vm, V::loadu(p + i));
        float lanes[W];
        vm.store(lanes);
        float m = lanes[0];
        bool nan = std::isnan(m);
        for (int64_t j = 1; j < W; ++j) {
            nan = nan || std::isnan(lanes[j]);
            m = lanes[j] > m ? lanes[j] : m;
        }
        for (; i < cols; ++i) {
            nan = nan || std::isnan(p[i]);
            m = p[i] > m ? p[i] : m;
        }
        int64_t at = 0;
        if (nan) {
            while (!std::isnan(p[at])) ++at;
        } else {
            const V vx(m);
            int64_t k = 0;
            // zero_mask: a bit for each lane equal to zero; a lane of (v == m) is all ones where it holds
            for (; k + W <= cols; k += W) {
                const int mask = ~(V::loadu(p + k) == vx).zero_mask() & ((1 << W) - 1);
                if (mask) break;
            }
            while (p[k] != m) ++k;
            at = k;
        }
        out[r] = at;
    }
}
"""

ARGTYPES = ["const float*", "int64_t*", "int64_t", "int64_t", "int64_t"]


@functools.lru_cache(maxsize=None)
def kernel():
    """The built kernel, once per process."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(ARGTYPES, SOURCE)


def unsupported(caps, shape: dict) -> str | None:
    """Why the kernel cannot serve this engine (None: it can)."""
    if caps.device_type != "cpu":
        return "the C++ argmax serves CPU engines"
    from compiled_llm.ops.cpu_attention import build_error

    return build_error(kernel)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 rows through the kernel; any other dtype, layout or an empty row through torch.argmax."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] == 0 or logits.stride(1) != 1:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel()(logits, out, logits.shape[0], logits.shape[1], logits.stride(0))
    return out
