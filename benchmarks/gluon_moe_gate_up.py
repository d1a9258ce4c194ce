"""Prototype: the MoE grouped GEMM's gate/up half (ops/triton/moe.py _gate_up_kernel) as a Gluon kernel (Hopper
wgmma + TMA, explicit layouts), at prefill sizes of Gemma 4 26B-A4B (E 128, H 2,816, I 704, top-8; --qwen: Qwen3.5
35B-A3B's E 256, H 2,048, I 512, SwiGLU). Its f and s variants are the engine's kernel now (ops/triton/gluon_moe.py;
f128x4 is the 128-row tiers' default on Hopper from session 66); the warp-specialized ones live here. The baseline
("engine" below) is the Triton kernel (TMA weight tiles, 128 x 64 tiles, 8 warps), ~486 TFLOP/s at 8,192 tokens on
an H100; this asks whether hand-placed layouts and a deeper pipeline get further. H100, session 65
(benchmarks/NOTES.md): every variant equal to the engine's output on every real row; at 8,192 tokens f128x4 and
w128x4 3-8% faster than the engine's kernel (two machines), 2-5% at 4,096, tied below (the weights' bytes bind).

Semantics, layout and the one-partition pipeline (the f and s variants): ops/triton/gluon_moe.py's docstring.
Warp-specialized (_gate_up_ws_kernel, variants w*): LOADER_WARPS producer warps (gl.warp_specialize) issue the
    cp.async rows and the TMA tiles; each loader thread's copies arrive on the stage's `ready` mbarrier through
    cp.async.mbarrier.arrive.noinc (so `ready` expects LOADER_WARPS * 32 arrivals plus the TMA's expect); the two
    consumer warpgroups only wait, fence, multiply, and release the stage of the step retired (`empty`, one
    arrive after a barrier of their 8 warps). No CTA-wide barrier in the loop, and the prefetch distance is the
    whole STAGES.
I = 704 is 11 x 64: BLOCK_N 128 computes 6 x 128 columns (the last tile's second half is the next rows of W,
discarded: 9% more tensor work for fewer A re-reads); BLOCK_N 64 wastes nothing.

Variants (VARIANTS): f<BN>x<STAGES> fused, s<BN>x<STAGES> two wgmma, w<BN>x<STAGES> warp-specialized (fused). The
row block is the engine policy's (64 rows at 1,024 tokens: 4 warps, one warpgroup; 128 from 2,048 on).
Built for sm_90a on the CPU (--build-only), 128-row blocks, Triton 3.6 / 3.8: shared memory, ptxas registers
(ws: the launch bound; setmaxnreg gives the consumers 208 and the loaders 88), no spills in any:
    f64x6  192.0 KiB 119 / 120    f64x3  96.0 KiB 119 / 120 (two CTAs an SM)    f128x4 192.0 KiB 178 / 173
    s64x6  192.0 KiB 119 / 120    w64x4 128.2 KiB 168           w64x6 192.2 KiB 168    w128x4 192.2 KiB 168

    python3 benchmarks/gluon_moe_gate_up.py --build-only [--variants f64x6,w64x6] [--block-m 128,64]
        # CPU: each variant built for sm_90a: shared memory, ptxas registers and spills, wgmma / TMA / cp.async
        # counts; exit 1 on a spill, shared memory past 227 KiB, or a failed build
    python3 benchmarks/gluon_moe_gate_up.py --dry-run [--tokens 1024,8192]
        # CPU: the GPU mode's set-up on CPU tensors (16 experts, H 256, a tenth of the tokens, the real token
        # count's policy), the engine's and the variants' launches recorded as on an H100 and built for sm_90a;
        # under Triton 3.7+ also --smoke
    python3 benchmarks/gluon_moe_gate_up.py --smoke
        # CPU (Triton 3.7+): the GPU mode's code end to end on small fp32 shapes, the engine's kernel in the
        # interpreter, the Gluon kernels stood in by torch (Gluon has no interpreter)
    python3 benchmarks/gluon_moe_gate_up.py [--tokens 1024,2048,4096,8192] [--variants ...] [--check-only]
        # GPU: each variant checked against the engine's gate/up output on every real row and an fp32 torch
        # reference on 512 sampled rows, then timed with CUDA-graph replays beside the engine's _gate_up_kernel
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the engine's kernel in the interpreter

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from compiled_llm.ops.triton import gluon_moe  # noqa: E402 - after the path set-up above
from compiled_llm.ops.triton.gluon_moe import BLOCK_K, gated_act, gathered_rows, store_act  # noqa: E402

# a CTA-wide barrier (bar.sync): gl.thread_barrier in Triton 3.6, gl.barrier from Triton 3.7 on
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
GEMMA4 = dict(E=128, H=2816, I=704, k=8, silu=False)
QWEN35 = dict(E=256, H=2048, I=512, k=8, silu=True)  # Qwen3.5 35B-A3B's routed experts (SwiGLU): --qwen
LOADER_WARPS, LOADER_REGS = 4, 88  # the warp-specialized variants' producer warps and their register budget
VARIANTS = {  # name: (BLOCK_N, STAGES, FUSED)
    "f64x6": (64, 6, True), "f64x4": (64, 4, True), "f128x4": (128, 4, True), "f128x3": (128, 3, True),
    "f64x3": (64, 3, True),  # 96 KiB: two CTAs an SM, one's epilogue under the other's main loop
    "s64x6": (64, 6, False),
    # warp-specialized (_gate_up_ws_kernel: 4 loader warps besides the consumer warpgroups; gate and up fused)
    "w64x4": (64, 4, "ws"), "w64x6": (64, 6, "ws"), "w128x4": (128, 4, "ws"),
    "w64x3": (64, 3, "ws"), "w128x2": (128, 2, "ws"), "w128x3": (128, 3, "ws"),  # (session 65's second call)
}
DEFAULT_VARIANTS = "f64x6,f64x3,f128x4,s64x6,w64x4,w64x6,w128x4"
REL_TOL = 2e-2  # max |variant - engine| / max |engine| over the real rows (bf16 outputs, different fp32 sum order)


@gluon.jit
def _ws_loader(X, SortedIds, w_desc, a_smem, w_smem, ready, empty, pid_m, n0, num_pairs, N, K, stride_xt,
               TOP_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               STAGES: gl.constexpr):
    """The warp-specialized kernel's producer warps: tile i's gathered A rows (cp.async, each thread's copies
    signalled on ready[i % STAGES] by a no-increment async arrive: LOADER_THREADS of its expected arrivals) and
    its gate / up tiles (TMA, the last arrival with the expected bytes), once the consumers freed the stage."""
    gl.static_assert(BLOCK_K == 64, "the row loads: 8 threads x 16 bytes a 128-byte row")
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    x_ptrs, rmask, kk = gathered_rows(X, SortedIds, pid_m, num_pairs, stride_xt, ld_layout, TOP_K, BLOCK_M, BLOCK_K)
    n_k = gl.cdiv(K, BLOCK_K)
    for i in range(0, n_k):
        st = i % STAGES
        # the consumers' release of the stage's previous tile (i - STAGES); the first round passes at once: a
        # fresh barrier counts its phase before 0 (parity 1) as complete
        mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
        k0 = i * BLOCK_K
        async_copy.async_copy_global_to_shared(a_smem.index(st), x_ptrs + k0,
                                               mask=rmask[:, None] & (kk < K - k0)[None, :])
        async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
        w_buf = w_smem.index(st)
        mbarrier.expect(ready.index(st), 2 * w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [n0, k0], ready.index(st), w_buf.slice(0, BLOCK_N))
        tma.async_copy_global_to_shared(w_desc, [n0 + N, k0], ready.index(st), w_buf.slice(BLOCK_N, BLOCK_N))


@gluon.jit
def _ws_mma(a_smem, w_smem, ready, empty, K, acc_layout: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """The consumer warpgroups (the default partition): one N = 2 BLOCK_N wgmma a K step, one step in flight;
    a stage is released (one arrive, after a barrier of the partition's warps, so both warpgroups are past it)
    once the step that read it has retired."""
    acc = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, acc_layout)
    n_k = gl.cdiv(K, BLOCK_K)
    for i in range(0, n_k):
        st = i % STAGES
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        fence_async_shared()  # the cp.async rows were written through the generic proxy; wgmma reads async
        acc = warpgroup_mma(a_smem.index(st), w_smem.index(st).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        _cta_barrier()  # both warpgroups have retired step i - 1
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    acc = warpgroup_mma_wait(0, deps=[acc])
    return (acc,)  # a tuple: Triton 3.6's warp_specialize iterates over the default partition's results


@gluon.jit(do_not_specialize=["num_pairs"])
def _gate_up_ws_kernel(X, w_desc, SortedIds, ExpertIds, NumPadded, Act, num_pairs, N, K, stride_xt, stride_an,
                       TOP_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr,
                       LOADER_REGS: gl.constexpr, SILU: gl.constexpr):
    """gluon_moe._gate_up_gluon_kernel (FUSED) warp-specialized: LOADER_WARPS producer warps fill STAGES stages, the
    BLOCK_M / 16 warps of the default partition only multiply; stage hand-offs through mbarriers (ready: the
    rows' async arrives and the TMA bytes; empty: the consumers' release), no CTA-wide barrier in the loop."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW * 16 == BLOCK_M, "a warp a 16-row slice of the wgmma tile")
    dtype: gl.constexpr = X.dtype.element_ty
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, 2 * BLOCK_N, 16])

    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    if pid_m * BLOCK_M >= gl.load(NumPadded):
        return
    e = gl.load(ExpertIds + pid_m)
    if e < 0:
        return
    n0 = e * 2 * N + pid_n * BLOCK_N

    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_sl)
    w_smem = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=LOADER_WARPS * 32 + 1)  # each loader thread's async arrive + TMA's
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()

    res = gl.warp_specialize([
        (_ws_mma, (a_smem, w_smem, ready, empty, K, acc_layout, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
        (_ws_loader, (X, SortedIds, w_desc, a_smem, w_smem, ready, empty, pid_m, n0, num_pairs, N, K, stride_xt,
                      TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
    ], [LOADER_WARPS], [LOADER_REGS])
    acc = res[0]
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))

    acc_g, acc_u = acc.reshape([BLOCK_M, 2, BLOCK_N]).permute((0, 2, 1)).split()
    store_act(gated_act(acc_g, acc_u, SILU).to(dtype), SortedIds, Act, pid_m, pid_n, num_pairs, N, stride_an,
              BLOCK_M, BLOCK_N)


def launch_args(x, gate_up_proj, sorted_ids, expert_ids, num_padded, act, top_k: int, block_m: int,
                variant: str, silu: bool = False):
    """(grid, args, kwargs) of the Gluon kernel: x [T, H]; gate_up_proj [E, 2I, H] (contiguous); moe_align's
    outputs at block_m; act [len(sorted_ids), I]. f and s variants: the engine's kernel (gluon_moe.py)."""
    bn, stages, fused = VARIANTS[variant]
    if fused != "ws":
        return gluon_moe.launch_args(x, gate_up_proj, sorted_ids, expert_ids, num_padded, act, top_k, block_m,
                                     silu=silu, block_n=bn, stages=stages, fused=fused)
    E, two_i, H = gate_up_proj.shape
    inter = two_i // 2
    assert gate_up_proj.is_contiguous() and x.stride(1) == 1 and act.stride(1) == 1 and block_m in (64, 128)
    box = [bn, BLOCK_K]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
    wd = TensorDescriptor.from_tensor(gate_up_proj.view(E * two_i, H), box, layout)
    grid = (triton.cdiv(inter, bn), expert_ids.numel())
    args = (x, wd, sorted_ids, expert_ids, num_padded, act, top_k * x.shape[0], inter, H,
            x.stride(0), act.stride(0))
    kwargs = dict(TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=BLOCK_K, STAGES=stages,
                  num_warps=block_m // 16, num_stages=1, LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS,
                  SILU=silu)
    return grid, args, kwargs


def kernel_of(variant: str):
    return _gate_up_ws_kernel if VARIANTS[variant][2] == "ws" else gluon_moe._gate_up_gluon_kernel


def gate_up_gluon(x, gate_up_proj, sorted_ids, expert_ids, num_padded, act, top_k, block_m, variant, silu=False):
    grid, args, kwargs = launch_args(x, gate_up_proj, sorted_ids, expert_ids, num_padded, act, top_k, block_m,
                                     variant, silu)
    kernel_of(variant)[grid](*args, **kwargs)
    return act


# ---------------------------------------------------------------------------------------------------------------
# CPU: builds for sm_90a (compiled_llm/runtime/kernel_check.py's build, no GPU needed)

def build_sm90(variant: str, block_m: int = 128, T: int = 64):
    """The variant built for sm_90a on this machine, for Gemma 4's H and I (two experts: the expert count is only
    the descriptor's runtime shape, and 128 experts' weights would be a 1 GB CPU tensor)."""
    from compiled_llm.runtime.kernel_check import Launch, build_sm90 as build

    E, H, I, k = 2, GEMMA4["H"], GEMMA4["I"], GEMMA4["k"]
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    w = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16)
    rows = 4 * block_m
    sorted_ids = torch.zeros(rows, dtype=torch.int32)
    expert_ids = torch.zeros(rows // block_m, dtype=torch.int32)
    act = torch.empty(rows, I, dtype=torch.bfloat16)
    _, args, kwargs = launch_args(x, w, sorted_ids, expert_ids, torch.zeros(1, dtype=torch.int32), act, k, block_m,
                                  variant)
    return build(Launch(kernel_of(variant), args, kwargs))


def usage(kernel) -> dict:
    from compiled_llm.runtime.kernel_check import ptxas_usage

    ptx = kernel.asm["ptx"]
    regs, spilled = ptxas_usage(ptx)
    return dict(shared=kernel.metadata.shared, regs=regs, spilled=spilled, wgmma=ptx.count("wgmma.mma_async"),
                tma=ptx.count("cp.async.bulk.tensor"), cp_async=ptx.count("cp.async.cg.shared.global")
                + ptx.count("cp.async.ca.shared.global"), local=ptx.count("ld.local") + ptx.count("st.local"))


def build_only(variants: list[str], block_ms: list[int], build=None) -> int:
    """Each variant at each row block built for sm_90a (build: variant, block_m -> kernel; this file's build_sm90 by
    default, gluon_moe_down.py passes its own), its usage printed; 1 on a failure, a spill or too much shared
    memory."""
    from compiled_llm.runtime.kernel_check import SMEM_LIMIT

    build = build or build_sm90
    print(f"triton {triton.__version__} torch {torch.__version__}: built for sm_90a")
    bad = 0
    for bm in block_ms:
        for v in variants:
            try:
                u = usage(build(v, bm))
            except Exception as exc:  # noqa: BLE001 - every variant is reported
                print(f"  BLOCK_M={bm:<3} {v:<8} FAILED {type(exc).__name__}: {str(exc).strip()[-400:]}")
                bad += 1
                continue
            fits = u["shared"] <= SMEM_LIMIT and u["spilled"] == 0
            bad += not fits
            print(f"  BLOCK_M={bm:<3} {v:<8} shared {u['shared']:6d} B ({u['shared'] / 1024:5.1f} KiB of 227) "
                  f"regs {u['regs']:3d} spill {u['spilled']:4d} B wgmma {u['wgmma']:3d} TMA {u['tma']:2d} "
                  f"cp.async {u['cp_async']:3d} local ld/st {u['local']}{'' if fits else '  OVER/SPILLS'}")
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------------------------
# the inputs and the engine's launch (shared by the GPU mode and --dry-run)

def make_case(T: int, dev, S: dict, seed: int = 1, pol=None, align=None, dtype=torch.bfloat16):
    """Random x, weights scaled so the products are O(1), random distinct top-k ids; the engine's alignment at
    its policy's block_m (pol: another policy, e.g. the real token count's where the dry run stands in smaller
    shapes; align: another alignment function); the engine's gate/up call (moe_launches' gate_up) and its
    activations buffer. dtype: float32 for --smoke (the engine's kernel in the interpreter; see smoke)."""
    from compiled_llm.ops.triton import moe as M

    E, H, I, k = S["E"], S["H"], S["I"], S["k"]
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, H, device=dev, generator=g).to(dtype)
    w = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H ** -0.5).to(dtype)
    # unused by gate/up, but contiguous: moe_launches' TMA check (tma_usable) looks at both weights
    down = torch.empty(E, H, I, device=dev, dtype=dtype)
    ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices.to(torch.int32)
    wts = torch.full((T, k), 1.0 / k, device=dev)
    # the engine's Triton kernel, the baseline (the 128-row tiers' default on Hopper is gluon_moe.py's f128x4)
    pol = dataclasses.replace(pol or M.moe_launch_policy(T, k, E, H, I), gluon=False)
    alignment = (align or M.moe_align)(ids, E, pol.block_m)
    gate_up, _ = M.moe_launches(x, w, down, wts, ids, policy=pol, alignment=alignment,
                                activation="silu" if S["silu"] else "gelu_tanh")
    return dict(x=x, w=w, ids=ids, pol=pol, alignment=alignment, engine=gate_up, T=T, S=S)


def engine_act(case) -> torch.Tensor:
    """The activations buffer moe_launches made (its gate_up closure's `act`)."""
    fn = case["engine"]
    return fn.__closure__[fn.__code__.co_freevars.index("act")].cell_contents


def gated(h: torch.Tensor, inter: int, silu: bool) -> torch.Tensor:
    """act_fn(h[:, :inter]) * h[:, inter:]: SwiGLU or GEGLU (tanh GELU) of the fused gate/up product."""
    g = torch.nn.functional.silu(h[:, :inter]) if silu else torch.nn.functional.gelu(h[:, :inter], approximate="tanh")
    return g * h[:, inter:]


def reference_rows(case, rows: torch.Tensor) -> torch.Tensor:
    """fp32 torch of the given padded rows (real ones): act_fn(x gate^T) * (x up^T)."""
    sorted_ids, expert_ids, _ = case["alignment"]
    k, I = case["S"]["k"], case["S"]["I"]
    pairs = sorted_ids[rows].long()
    e = expert_ids[rows // case["pol"].block_m].long()
    xs = case["x"][pairs // k].float()
    out = torch.empty(rows.numel(), I, device=xs.device)
    for ex in e.unique().tolist():
        sel = e == ex
        h = xs[sel] @ case["w"][ex].float().T
        out[sel] = gated(h, I, case["S"]["silu"])
    return out


def dry_run(tokens: list[int], variants: list[str]) -> int:
    """The GPU mode's host side on CPU tensors, cheaply: 16 experts and H 256 (Gemma 4's I and top-8), a tenth of
    the tokens, at the policy (block_m, tiles) of the real token count; the alignment by torch's ops
    (moe_align_sorted: moe_align's outputs without a Triton launch), so sorted_ids and the fp32 reference are
    real. The engine's and each variant's launches are recorded (as on an H100) and built for sm_90a."""
    from compiled_llm.ops.triton import moe as M
    from compiled_llm.runtime.kernel_check import recorded_launches

    ok = True
    S = dict(GEMMA4, E=16, H=256)
    for T in tokens:
        pol = M.moe_launch_policy(T, GEMMA4["k"], GEMMA4["E"], GEMMA4["H"], GEMMA4["I"])
        small = max(1, T // 10)
        with recorded_launches(as_sm90=True) as launches, torch.inference_mode():
            case = make_case(small, torch.device("cpu"), S, pol=pol, align=M.moe_align_sorted)
            case["engine"]()
            sorted_ids, expert_ids, num_padded = case["alignment"]
            act = torch.empty(sorted_ids.numel(), S["I"], dtype=torch.bfloat16)
            for v in variants:
                gate_up_gluon(case["x"], case["w"], sorted_ids, expert_ids, num_padded, act, S["k"], pol.block_m, v)
            real = torch.nonzero(sorted_ids < small * S["k"]).flatten()
            ref = reference_rows(case, real[torch.randperm(real.numel())[:64]])
        good = real.numel() == small * S["k"] and bool(torch.isfinite(ref).all()) and ref.abs().max() > 0.1
        ok &= good
        print(f"T={T} (on the CPU: {small} tokens, E {S['E']}, H {S['H']}): block_m {pol.block_m}, padded "
              f"{int(num_padded)} rows in {expert_ids.numel()} blocks, fp32 reference of 64 rows max "
              f"{float(ref.abs().max()):.2f}{'' if good else ' FAILED'}")
        ok &= build_recorded(launches)
    return finish_dry_run(ok, __file__, variants)


def build_recorded(launches, skip: tuple = ()) -> bool:
    """Each recorded launch (but the kernels named in skip) built for sm_90a, a line each; all within shared
    memory and without spills."""
    from compiled_llm.runtime.kernel_check import SMEM_LIMIT, check_launch

    ok = True
    for lz in launches:
        if lz.name in skip:
            continue
        b = check_launch(lz)
        good = not b.error and b.shared <= SMEM_LIMIT and b.spilled == 0
        ok &= good
        what = b.error or f"{b.shared} B shared, {b.registers} regs, {b.spilled} B spilled, wgmma {b.wgmma}"
        tiles = (lz.kwargs.get("BLOCK_M"), lz.kwargs.get("BLOCK_N"), lz.kwargs.get("STAGES", lz.kwargs.get(
            "num_stages")), "TMA" if lz.kwargs.get("TMA") or "w_desc" in str(lz.kernel.arg_names) else "")
        print(f"  {lz.name:<24} grid {lz.grid} tiles {tiles}: {what}{'' if good else '  FAILED'}")
    return ok


def finish_dry_run(ok: bool, script: str, variants: list[str]) -> int:
    """The dry run's end: the script's --smoke where the interpreter runs the engine's kernels (Triton 3.7 on;
    3.6's fails inside the gate/up kernel's K loop), then the verdict."""
    import subprocess

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 7):
        print("--smoke (the GPU mode's code on the CPU, the engine's kernel in the interpreter):", flush=True)
        ok &= subprocess.run([sys.executable, script, "--smoke", "--variants", ",".join(variants)]).returncode == 0
    else:
        print(f"  (--smoke, the GPU mode's code on the CPU: Triton 3.7+ only, this is {triton.__version__})")
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


def torch_gate_up(x, gate_up_proj, sorted_ids, expert_ids, num_padded, act, top_k, block_m, variant, silu=False):
    """gate_up_gluon's semantics in torch, block by block (--smoke's stand-in for the Gluon kernels, which have no
    interpreter): real rows written, padding rows and skipped blocks left alone."""
    n, inter = x.shape[0] * top_k, gate_up_proj.shape[1] // 2
    for b in range(int(num_padded) // block_m):
        e = int(expert_ids[b])
        rows = torch.arange(b * block_m, (b + 1) * block_m, device=x.device)
        pair = sorted_ids[rows].long()
        real = pair < n
        if e < 0 or not bool(real.any()):
            continue
        h = x[pair[real] // top_k].float() @ gate_up_proj[e].float().T
        act[rows[real]] = gated(h, inter, silu).to(act.dtype)
    return act


def smoke(variants: list[str]) -> int:
    """The GPU mode's code on the CPU (TRITON_INTERPRET=1, set at import): 8 experts, H 128, I 64, fp32 (in bf16
    the engine's kernel gave values of 1e22 under the 3.8 interpreter), the engine's gate/up kernel in the
    interpreter, each Gluon variant stood in by torch_gate_up: the checks (engine_act, the real rows,
    reference_rows), the timing calls and the table run as on the GPU. 40 tokens take the 64-row tier, 160 the
    128-row one."""
    global gate_up_gluon
    gate_up_gluon = torch_gate_up
    return gpu_main([40, 160], variants, False, dev=torch.device("cpu"), S=dict(GEMMA4, E=8, H=128, I=64),
                    dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# GPU: check and timing

HANG_S = 90


def _hung(T: int, variant: str) -> None:
    print(f"T={T} {variant}: no result after {HANG_S} s, the build included: a hang (a pipeline barrier's bug?); "
          f"exiting: rerun without it", flush=True)
    os._exit(3)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def gpu_main(tokens: list[int], variants: list[str], check_only: bool, dev=None, S: dict = GEMMA4,
             dtype=torch.bfloat16) -> int:
    """dev, S, dtype: another device and shapes (a CPU run of this code under the interpreter, the kernels
    stood in for: tests of this file)."""
    from graph_timing import kernel_timer

    dev = dev or torch.device("cuda")
    time_fn = kernel_timer(dev.type != "cuda", calls=5, replays=10)
    ok, rows = True, []
    for T in tokens:
        case = make_case(T, dev, S, seed=T, dtype=dtype)
        sorted_ids, expert_ids, num_padded = case["alignment"]
        bm = case["pol"].block_m
        num_pairs = T * S["k"]
        case["engine"]()
        ref_act = engine_act(case)
        _sync(dev)
        real = torch.nonzero(sorted_ids < num_pairs).flatten()  # the padded rows that hold a pair
        assert real.numel() == num_pairs
        sample = real[torch.randperm(real.numel(), device=dev)[:512]]
        ref32 = reference_rows(case, sample)
        eng = ref_act[real].float()
        scale = float(eng.abs().max())
        e_err = float((ref_act[sample].float() - ref32).abs().max()) / float(ref32.abs().max())
        ok &= e_err < REL_TOL  # the check of the check: the engine's rows, as this file picks them, match fp32
        print(f"T={T}: block_m {bm}, {expert_ids.numel()} row blocks, padded {int(num_padded)} rows; engine vs fp32 "
              f"on {sample.numel()} rows {e_err:.2e} of max |ref|{'' if e_err < REL_TOL else ' FAIL'}", flush=True)
        flops = 2.0 * num_pairs * 2 * S["I"] * S["H"]
        row = dict(T=T, flops=flops, engine=None if check_only else time_fn(case["engine"]))
        if row["engine"]:
            print(f"T={T} engine: {row['engine']:.1f} us ({flops / row['engine'] / 1e6:.0f} TFLOP/s)", flush=True)
        inputs = (case["x"], case["w"], sorted_ids, expert_ids, num_padded)
        for v in variants:
            act = torch.full_like(ref_act, float("nan"))  # rows the kernel misses show up as NaN in the check
            try:
                # a pipeline's barrier bug hangs the GPU, not Python: past HANG_S (the build included) the process
                # says which variant it was and exits, rather than waiting for the machine's time limit
                watchdog = threading.Timer(HANG_S, _hung, (T, v))
                watchdog.start()
                try:
                    gate_up_gluon(*inputs, act, S["k"], bm, v, S["silu"])
                    _sync(dev)  # (torch.cuda.synchronize releases the GIL: the watchdog's thread runs meanwhile)
                finally:
                    watchdog.cancel()
                d_eng = float((act[real].float() - eng).abs().max()) / scale
                d_ref = float((act[sample].float() - ref32).abs().max()) / float(ref32.abs().max())
                good = d_eng < REL_TOL and d_ref < REL_TOL and bool(torch.isfinite(act[real]).all())
            except Exception as exc:  # a build or launch failure is reported, the other variants still run
                print(f"T={T} {v}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                ok, row[v] = False, None
                continue
            ok &= good
            print(f"T={T} {v}: max |gluon - engine| / max |engine| {d_eng:.2e} over the {num_pairs} real rows, "
                  f"vs fp32 {d_ref:.2e} on {sample.numel()} ({'ok' if good else f'FAIL: over {REL_TOL}'})",
                  flush=True)
            if good and not check_only:
                try:
                    row[v] = time_fn(lambda: gate_up_gluon(*inputs, act, S["k"], bm, v, S["silu"]))
                    print(f"T={T} {v}: {row[v]:.1f} us ({flops / row[v] / 1e6:.0f} TFLOP/s)", flush=True)
                except Exception as exc:  # noqa: BLE001 - e.g. a capture failure: reported, the others still run
                    print(f"T={T} {v}: timing failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                    ok = False
        rows.append(row)
    if not check_only:
        print_table(dev, rows, variants, "2 * pairs * 2I * H", [
            "engine: moe_launches' gate_up() (_gate_up_kernel at the policy's tiles); variants: BLOCK_N x STAGES,",
            "f = gate and up in one wgmma of N = 2 BLOCK_N, s = two wgmma, w = f warp-specialized (loader warps);",
            "CUDA-graph replays, 5 calls a graph, 10 replays"])
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


def print_table(dev, rows: list[dict], variants: list[str], flops_of: str, legend: list[str]) -> None:
    """The GPU mode's table: a row a token count, us a call of the engine and each variant (TFLOP/s of useful
    work, flops_of saying how it is counted), then the legend."""
    cols = ["engine"] + variants
    name = torch.cuda.get_device_name() if dev.type == "cuda" else str(dev)
    print(f"\n{name}, triton {triton.__version__}; us a call (TFLOP/s of useful work, {flops_of})")
    print(f"{'T':>6} " + " ".join(f"{c:>18}" for c in cols))
    for row in rows:
        cells = [f"{row[c]:>8.1f} ({row['flops'] / row[c] / 1e6:>5.0f})" if row.get(c) else f"{'-':>18}" for c in cols]
        print(f"{row['T']:>6} " + " ".join(f"{x:>18}" for x in cells))
    for line in legend:
        print(line)


def cli(module, tokens: str, block_m: str) -> int:
    """Both prototypes' command line: module (this one, or gluon_moe_down) gives VARIANTS, DEFAULT_VARIANTS and the
    modes build_only, smoke, dry_run, gpu_main; tokens and block_m are its defaults."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-only", action="store_true", help="compile for sm_90a on the CPU, print usage")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the GPU mode's launches recorded and built")
    ap.add_argument("--tokens", default=tokens)
    ap.add_argument("--variants", default=module.DEFAULT_VARIANTS, help=f"of {','.join(module.VARIANTS)}")
    ap.add_argument("--block-m", default=block_m, help="--build-only: row blocks to build")
    ap.add_argument("--check-only", action="store_true", help="GPU: correctness only, no timing")
    ap.add_argument("--qwen", action="store_true", help="GPU: Qwen3.5 35B-A3B's experts (SwiGLU), not Gemma 4's")
    ap.add_argument("--smoke", action="store_true", help="CPU (Triton 3.7+): the GPU mode's code, the engine in the "
                    "interpreter, the Gluon kernels stood in by torch")
    a = ap.parse_args()
    variants = a.variants.split(",")
    assert all(v in module.VARIANTS for v in variants), variants
    if a.build_only:
        return module.build_only(variants, [int(b) for b in a.block_m.split(",")])
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.smoke:
        return module.smoke(variants)
    if a.dry_run:
        return module.dry_run(tokens, variants)
    return module.gpu_main(tokens, variants, a.check_only, **(dict(S=QWEN35) if a.qwen else {}))


if __name__ == "__main__":
    sys.exit(cli(sys.modules[__name__], "1024,2048,4096,8192", "128,64"))
