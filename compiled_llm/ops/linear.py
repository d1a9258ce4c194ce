"""skinny_mm: a decode step's weight-streaming projections, x [M <= 16, K] @ W [N, K]^T, where our skinny GEMM beats
cuBLAS: every narrow product (N < K: Gemma 4's o_proj, Qwen3.5's out_proj and o_proj, its shared expert's gate_up),
and the wide ones (N >= K) measured faster on this GPU (WIDE_MEASURED: Gemma 4's global-layer qkv, Qwen3.5's merged
in_proj, both LM heads on an H200; the LM heads on an H100).

At a decode batch these products stream their weight. For N < K cuBLAS picks a split-K kernel plus a second launch
that adds the slices (`splitKreduce_kernel`, ~1.8 us and a launch gap on the H200). The Triton provider
(ops/triton/skinny_gemm.py) splits K four ways too, but the last program of each output tile adds the slices
(`merge`): one launch. H200, CUDA-graph replays, weights from HBM (benchmarks/skinny_gemm.py, session 28), us at
M = 8: Gemma 4 o_proj 10.61 -> 9.66 (sliding) and 16.26 -> 15.03 (global), Qwen3.5 out_proj 8.99 -> 7.65, its
full-attention o_proj 8.98 -> 7.63, its shared expert's gate_up 5.57 -> 4.25. Where N >= K cuBLAS takes no split,
and our unsplit 32-row tile wins at some shapes only (global qkv 18.60 -> 16.27, but sliding qkv 13.61 against
14.08): those go by the measured table, per GPU model. passes/skinny_mm.py rewrites the products this op takes in
the compiled graph; the LM head, computed outside it, calls `linear_rows`. Every decode batch size replays the
dynamic-token compile by default, so the op decides by the call's row count: up to 16 rows the provider, past them
torch's mm (cuBLAS).

The sum over K is float32 in both; the slices are added in a fixed order (deterministic), a different order
from cuBLAS's, so outputs may differ from torch.mm's in the last bf16 place.

On the CPU the op has a oneDNN provider (`packed_mm`): the weight is reordered once into oneDNN's blocked layout
for a few rows (`mkldnn._reorder_linear_weight`, the copy Inductor's freezing makes of a constant weight), kept
beside the parameter, and every later product streams that copy (`mkldnn._linear_pointwise`). At a decode
batch MKL's sgemm streams a [N, K] weight slowly: on this project's 2-core CPU machine (AMD EPYC, AVX-512), 8 rows
through the 24 projections and the LM head of benchmarks/host_overhead.py's model (22.5 MB of float32 weights,
cache cold as in a decode step) took 2.69 ms with torch.mm and 1.25 ms packed; the whole benchmark (8 x 64-token
prompts, 64 decode steps) 0.53-0.58 s -> 0.33-0.41 s, 1.06x -> 1.5x transformers eager (2026-12-05, session 40,
benchmarks/NOTES.md). On the CPU every projection whose weight is a parameter is the op's (`takes` on "cpu").
The copy costs the weight's bytes again in host memory (`COMPILED_LLM_SKINNY_MM=0`: none made, torch.mm).

Which library wins depends on the CPU: on an Intel Xeon with AMX (2 cores, session 44) oneDNN's packed product
has a ~28 us floor per call where MKL's sgemm takes 10-17 us at 8 rows for the host-overhead model's 256-wide
projections, while the 8,192-row LM head runs 2x faster packed (293 against 556 us). So the provider times both
on the first call of each weight shape and row-count bucket (`CPU_CHOICES`, the best of a few alternating runs
on that call's operands) and keeps the faster for the process; `COMPILED_LLM_CPU_MM=onednn|mm` pins one.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F

from compiled_llm.ops.registry import Capabilities, OpSpec, Provider, custom_op, register

log = logging.getLogger("compiled_llm")

SKINNY_MAX_ROWS = 16  # one 16-row block of the kernel: past it the weight would be read once per block
SKINNY_MIN_ELEMENTS = 1 << 21  # smaller weights (4 MB in bf16) are launch-bound either way: not measured
ENV = "COMPILED_LLM_SKINNY_MM"  # 0: every projection on cuBLAS / torch.mm (the pass off, linear_rows too): an A/B
CPU = "cpu"  # takes()'s device for a CPU engine: every weight (the oneDNN provider)
WIDE_ENV = "COMPILED_LLM_SKINNY_WIDE"  # 0: the wide shapes stay on cuBLAS (an A/B of WIDE_MEASURED)
# "NxK[:split],...": wide weights [N, K] the op takes on any GPU model besides WIDE_MEASURED's, on the unsplit tile or,
# with ":split", on the narrow weights' split launch (an A/B before a shape enters the table; "none": no shape)
WIDE_ADD_ENV = "COMPILED_LLM_SKINNY_WIDE_ADD"

# Wide weights (N >= K, [N, K]) whose products at 1-8 rows our unsplit 32-row tile (skinny_gemm.py WIDE_LAUNCH) ran
# at least 3% faster than cuBLAS on that GPU model, at every row count measured (benchmarks/skinny_gemm.py prints
# this table for the GPU it runs on: its "wide shapes" line; tests/test_benchmarks.py rebuilds it from the run).
# H200, session 28, us at M = 1 / 8: Gemma 4's global [q; k] 17.96 / 18.60 -> 15.99 / 16.27, Qwen3.5's merged
# in_proj 15.84 / 16.12 -> 14.60 / 14.90, the LM heads
# 346.1 / 350.9 -> 332.1 / 339.0 (Gemma 4) and 244.5 / 249.4 -> 229.3 / 236.1 (Qwen3.5). Left on cuBLAS there:
# Gemma 4's sliding qkv (8,192 x 2,816: 13.61 against 14.08) and Qwen3.5's full-attention qkv (9,216 x 2,048: 11.84
# against 12.55); the margin keeps a shape whose ranking could flip between machines out.
# H100 80GB HBM3, session 53 (the same rule, us at M = 1 / 8): only the LM heads, Gemma 4's 515.3 / 521.0 -> 477.1 /
# 486.5 and Qwen3.5's 353.8 / 358.7 -> 328.4 / 336.8; the merged in_proj 20.3 / 20.1 -> 19.5 / 19.8 misses the margin.
WIDE_MEASURED: dict[str, frozenset[tuple[int, int]]] = {
    "NVIDIA H200": frozenset({(9216, 2816), (12352, 2048), (262144, 2816), (248320, 2048)}),
    "NVIDIA H100 80GB HBM3": frozenset({(262144, 2816), (248320, 2048)}),
}


def enabled() -> bool:
    """The op takes its products (`COMPILED_LLM_SKINNY_MM=0`: none, for the pass and linear_rows alike)."""
    return os.environ.get(ENV, "1") != "0"


def device_name(device: torch.device | str | None = None) -> str | None:
    """The CUDA device's model name ("NVIDIA H200"), None for another device type or where CUDA is absent (torch
    caches the properties: a lookup)."""
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.get_device_properties(device.index if device.index is not None else
                                                torch.cuda.current_device()).name
    except (AssertionError, RuntimeError):  # no CUDA here: no measured wide shapes
        return None


def takes_device(device: torch.device | str) -> str | None:
    """takes()'s device: CPU for a CPU device, else the CUDA device's model name."""
    return CPU if torch.device(device).type == "cpu" else device_name(device)


def wide_shapes(name: str | None) -> frozenset[tuple[int, int]]:
    """The measured wide weight shapes of a GPU model (none where it was not measured, or WIDE_ENV=0)."""
    if name is None or os.environ.get(WIDE_ENV, "1") == "0":
        return frozenset()
    return WIDE_MEASURED.get(name, frozenset()) | frozenset(added_wide())


def added_wide() -> Mapping[tuple[int, int], bool]:
    """WIDE_ADD_ENV's shapes: {(n, k): whether on the split launch}. Parsed once per value of the variable: the LM
    head's product asks on every decode step (linear_rows, then the launch)."""
    return _parse_added_wide(os.environ.get(WIDE_ADD_ENV, ""))


@functools.lru_cache(maxsize=8)
def _parse_added_wide(text: str) -> Mapping[tuple[int, int], bool]:
    out = {}
    for item in text.replace("none", "").split(","):
        if item.strip():
            shape, _, launch = item.strip().partition(":")
            n, k = (int(v) for v in shape.split("x"))
            if launch not in ("", "split"):
                raise ValueError(f"{WIDE_ADD_ENV}: {item!r}: expected NxK or NxK:split")
            out[(n, k)] = launch == "split"
    return MappingProxyType(out)


def ref_skinny_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w.t())


def _triton(caps: Capabilities, shape: dict) -> str | None:
    return caps.triton_ok()


def _onednn(caps: Capabilities, shape: dict) -> str | None:
    if caps.device_type != "cpu":
        return "oneDNN's packed weights serve the CPU"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (MKL-DNN)"
    dtype = shape.get("dtype", torch.float32)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 instructions for oneDNN"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype}: oneDNN's packed products here take float32 and bfloat16"
    return None


PACKED_ROWS = 8  # the row count oneDNN's weight layout is chosen for (any count runs on it)
PACKS = [0]  # weights packed in this process: a test's check that a step repacks nothing


def _packed(w: torch.Tensor) -> torch.Tensor | None:
    """w's oneDNN copy, made on first use and kept on the parameter itself (so it dies with it), made again if
    the parameter was written since (a weight reload); None for a tensor that is not a parameter (packing it
    on every call would cost more than the product)."""
    if not isinstance(w, torch.nn.Parameter):
        return None
    try:
        version = w._version
    except RuntimeError:  # an inference tensor: no version counter, never written in place after loading
        version = -1
    hit = w.__dict__.get("_onednn_packed")
    if hit is None or hit[0] != version:
        PACKS[0] += 1
        hit = w.__dict__["_onednn_packed"] = (version, torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACKED_ROWS))
    return hit[1]


CPU_MM_ENV = "COMPILED_LLM_CPU_MM"  # onednn | mm: the CPU product's library pinned (default: measured per shape)
PINNED = os.environ.get(CPU_MM_ENV) or None  # read once (the env var's value; tests set this)
CPU_CHOICES: dict[tuple, str] = {}  # (N, K, dtype, row bucket) -> "onednn" | "mm", measured once in the process
MEASURE_BUDGET_S = 2e-3  # a choice's timed runs of each library take about this long (at least MEASURE_MIN_RUNS)
MEASURE_MIN_RUNS, MEASURE_MAX_RUNS = 3, 25
MAX_BUCKET = 4096  # row counts past this share the choice measured at the first of them
_BUCKETS = [1] + [min(MAX_BUCKET, 1 << (m - 1).bit_length()) for m in range(1, MAX_BUCKET + 1)]


def row_bucket(rows: int) -> int:
    """The rows' power of two (capped): a decode batch of 5 to 8 rows takes the choice of the first such call."""
    return _BUCKETS[rows] if rows <= MAX_BUCKET else MAX_BUCKET


def faster(times_mm: list[float], times_onednn: list[float]) -> str:
    """The library with the lower best time (the best of alternating runs: this shared host's noise only adds)."""
    return "onednn" if min(times_onednn) < min(times_mm) else "mm"


def _measure(x: torch.Tensor, w: torch.Tensor, p: torch.Tensor) -> tuple[str, float, float]:
    def mm():
        torch.mm(x, w.t())

    def dnn():
        torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    dnn()  # oneDNN's primitive made and cached, MKL's first call: not timed
    t0 = time.perf_counter()
    mm()
    once = time.perf_counter() - t0
    runs = max(MEASURE_MIN_RUNS, min(MEASURE_MAX_RUNS, int(MEASURE_BUDGET_S / max(once, 1e-7))))
    times = {mm: [], dnn: []}
    for _ in range(runs):
        for f in (mm, dnn):
            t0 = time.perf_counter()
            f()
            times[f].append(time.perf_counter() - t0)
    return faster(times[mm], times[dnn]), min(times[mm]), min(times[dnn])


def cpu_choice(x: torch.Tensor, w: torch.Tensor) -> str:
    """"onednn" or "mm" for x @ w^T on the CPU: COMPILED_LLM_CPU_MM's where set, else the one measured faster on the
    first call of its (shape, dtype, row bucket), kept for the process (and on the parameter, by bucket: a step's
    ~25 calls each look it up)."""
    if PINNED:
        if PINNED not in ("onednn", "mm"):
            raise ValueError(f"{CPU_MM_ENV}={PINNED!r}: expected onednn or mm")
        return PINNED
    bucket = row_bucket(x.shape[0])
    mine = w.__dict__.get("_cpu_mm")
    if mine is not None and bucket in mine:
        return mine[bucket]
    key = (w.shape[0], w.shape[1], w.dtype, bucket)
    choice = CPU_CHOICES.get(key)
    if choice is None:
        choice, t_mm, t_dnn = _measure(x, w, _packed(w))
        CPU_CHOICES[key] = choice
        log.debug("skinny_mm on the CPU, %d rows x %s: torch.mm %.1f us, oneDNN packed %.1f us -> %s", bucket,
                  tuple(w.shape), t_mm * 1e6, t_dnn * 1e6, choice)
    w.__dict__.setdefault("_cpu_mm", {})[bucket] = choice
    return choice


def packed_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The CPU provider: x @ w^T through w's oneDNN copy or torch.mm, whichever cpu_choice measured faster for
    this shape (torch.mm for a weight that is not a parameter)."""
    if not isinstance(w, torch.nn.Parameter):
        return torch.mm(x, w.t())
    x = x.contiguous()
    if cpu_choice(x, w) == "mm":
        return torch.mm(x, w.t())
    return torch.ops.mkldnn._linear_pointwise(x, _packed(w), None, "none", [], "")


SKINNY_MM = register(OpSpec("skinny_mm", "x [M <= 16, K] @ W [N, K]^T: a decode batch's weight-streaming "
                            "projections", [
    Provider("triton", "compiled_llm.ops.triton.skinny_gemm:decode_mm", _triton, capturable=True),
    Provider("onednn", "compiled_llm.ops.linear:packed_mm", _onednn),
    Provider("reference", "compiled_llm.ops.linear:ref_skinny_mm", capturable=True),
]))


def takes(n: int, k: int, m: int | None = None, device: str | None = None) -> bool:
    """The products the op serves: a weight worth streaming with a narrow output, or a wide one measured faster on
    the GPU model `device` (a name: device_name()), or on a CPU engine (`device` CPU) every weight; m, where known:
    a decode batch's rows (a symbolic row count is decided per call by the op)."""
    if m is not None and not 1 <= m <= SKINNY_MAX_ROWS:
        return False
    if device == CPU:
        return True
    if n < k:
        return n * k >= SKINNY_MIN_ELEMENTS
    return (n, k) in wide_shapes(device)


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T outside a compiled graph (the LM head): through skinny_mm where its Triton provider (a
    CUDA engine) or oneDNN one (a CPU engine) was chosen and the op takes the product on this device, else
    F.linear."""
    if (x.dim() == 2 and x.dtype == w.dtype and SKINNY_MM.provider_name() in ("triton", "onednn") and enabled()
            and takes(w.shape[0], w.shape[1], x.shape[0], takes_device(x.device))):
        return torch.ops.compiled_llm.skinny_mm(x, w)
    return F.linear(x, w)


@custom_op("compiled_llm::skinny_mm", mutates_args=())
def skinny_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T: the chosen provider up to SKINNY_MAX_ROWS rows (a decode batch), torch's mm past them (a prefill
    piece of the dynamic-token compile, which every decode size replays too: its CUDA graph records the branch
    its size took). oneDNN's packed weights take every row count: at 512 rows they ran the 6-layer
    host-overhead model's prefill products ~15% faster than torch's mm (MKL) on 2 cores."""
    if x.shape[0] > SKINNY_MAX_ROWS and SKINNY_MM.provider_name() != "onednn":
        return torch.mm(x, w.t())
    return SKINNY_MM.impl()(x, w)


@skinny_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])
