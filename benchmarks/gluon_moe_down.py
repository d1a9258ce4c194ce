"""The MoE grouped GEMM's down half (ops/triton/moe.py _down_kernel's TMA path and _down_persistent_kernel) as a
persistent Gluon kernel (Hopper wgmma + TMA, explicit layouts), at prefill sizes of Gemma 4 26B-A4B (E 128,
H 2,816, I 704, top-8). The gate/up half's prototype is gluon_moe_gate_up.py, whose helpers (the build's usage
numbers, the gate/up inputs, the hang watchdog's length) this file imports. The engine's persistent kernel reaches
~455 TFLOP/s at 8,192 tokens on an H100 (~570 us a layer).

Semantics as the engine's: act [padded rows, I] (the gate/up output; a row block's rows contiguous), down_proj
[E, H, I]; y[pair] = topk_weight[pair] * (act[row] @ down[e].T) in bf16 at row `pair` of y [T k, H]; padding rows
(pair == num_pairs) not stored; a block of expert -1 (another rank's) stores zeros for its pairs.

Design. K = I = 704 is only 11 K steps of 64, so a tile's prologue and epilogue are a large share of it: one CTA an
SM walks the tiles (row block, column block; column blocks of a row block in turn, the engine's order, so a
block's activation rows come from L2 after the first column block) and the stage ring runs across tiles: the
loads of the next tile's first STAGES - 1 K steps are in flight while this tile's epilogue runs.
  - A: the block's activation rows, [BLOCK_M, 64] TMA boxes of act; W: [BLOCK_N, 64] boxes of down_proj viewed
    as [E * H, I]; both onto one mbarrier a stage (the expected bytes of both tiles).
  - MMA: BLOCK_M = 128 rows in two consumer warpgroups (8 warps, wgmma accumulators in NVMMADistributedLayout
    warps_per_cta=[8, 1]: 64 rows each), one wgmma of N = BLOCK_N a K step, one step kept in flight
    (warpgroup_mma_wait(1)). Past that wait and a CTA barrier both warpgroups have retired step i - 1, so the
    load of step i + STAGES - 1 goes into its stage: prefetch distance STAGES - 1, one barrier a step. The
    step counter (and so each stage's mbarrier phase) continues from tile to tile.
  - Epilogue: rows scaled by their pick's weight in fp32 (zeros for a block of expert -1, as the engine), bf16
    into a dedicated shared buffer (the stage ring is busy with the next tile's loads), read back row-major and
    stored with 16-byte row-masked stores to the pairs' rows (scattered rows: no TMA store).
  - Warp-specialized (_down_ws_kernel, variants w*): LOADER_WARPS producer warps (gl.warp_specialize; one thread
    issues the TMA) walk the CTA's K steps, each stage handed over by mbarriers (ready: the TMA bytes; empty:
    the consumers' release, one arrive after a barrier of their 8 warps); no CTA-wide barrier in the loop, the
    prefetch distance is the whole STAGES, and the loads run on through the consumers' epilogue.
Variants (VARIANTS): p<BLOCK_N>x<STAGES> (one partition), w<BLOCK_N>x<STAGES> (warp-specialized). Shared memory:
STAGES * (16 KiB + BLOCK_N * 128 B) + the epilogue's BLOCK_M * BLOCK_N * 2 B; p256x3 (the engine's 8,192-token
tile) is 208 KiB, 256 x 4 stages would be 256 KiB (over 227).
Built for sm_90a on the CPU (--build-only), 128-row blocks, Triton 3.6 and 3.8 alike: shared memory, ptxas
registers (w*: the launch bound; setmaxnreg gives the consumers 232, the loaders 40), no spills in any:
    p256x3 208.0 KiB 157    p256x2 160.0 KiB 157    p128x4 160.0 KiB 93    p128x5 192.0 KiB 93    p128x6 224.0 KiB 93
    w256x3 208.2 KiB 168    w128x4 160.2 KiB 168    w128x6 224.2 KiB 168
No GPU has run these yet: correctness (the barriers' phases across tiles) and speed are the GPU mode's to settle.
The one-partition kernel (p variants) is the engine's, imported: ops/triton/gluon_moe.py _down_gluon_kernel, which
moe.py runs for the 128-row prefill tiers under COMPILED_LLM_MOE_GLUON_DOWN=1 (off by default until measured);
the warp-specialized one lives here.

    python3 benchmarks/gluon_moe_down.py --build-only [--variants p256x3,p128x4]
        # CPU: each variant built for sm_90a: shared memory, ptxas registers and spills, wgmma / TMA counts; exit 1
        # on a spill, shared memory past 227 KiB, or a failed build
    python3 benchmarks/gluon_moe_down.py --dry-run [--tokens 2048,8192]
        # CPU: the GPU mode's set-up on CPU tensors (16 experts, H 256, a tenth of the tokens, the real token
        # count's policy), the engine's and the variants' launches recorded as on an H100 and built for sm_90a
    python3 benchmarks/gluon_moe_down.py [--tokens 2048,4096,8192] [--variants ...] [--check-only]
        # GPU: each variant checked against the engine's down() on every real pair row and an fp32 torch reference
        # on 512 sampled rows, then timed with CUDA-graph replays beside the engine's down kernel
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the engine's kernel in the interpreter

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gluon_moe_gate_up as G  # noqa: E402 - after the path set-up above
from compiled_llm.ops.triton.gluon_moe import (_down_gluon_kernel, _down_load_step,  # noqa: E402
                                               _down_store_tile, down_launch_args)

GEMMA4 = G.GEMMA4
BLOCK_K = G.BLOCK_K
_cta_barrier = G._cta_barrier
VARIANTS = {  # name: (BLOCK_N, STAGES[, "ws"])
    "p256x3": (256, 3),  # the engine's 8,192-token tile: 144 KiB of stages + 64 KiB epilogue buffer
    "p128x4": (128, 4), "p128x5": (128, 5), "p128x6": (128, 6),  # 32 KiB a stage + 32 KiB epilogue buffer
    "p256x2": (256, 2),  # prefetch distance 1: what the third stage buys
    # warp-specialized (_down_ws_kernel: LOADER_WARPS TMA warps besides the consumer warpgroups)
    "w256x3": (256, 3, "ws"), "w128x4": (128, 4, "ws"), "w128x6": (128, 6, "ws"),
}
LOADER_WARPS, LOADER_REGS = 4, 40  # a warpgroup (setmaxnreg's unit) of which one thread issues the TMA
DEFAULT_VARIANTS = "p256x3,p128x4,p128x6,w256x3,w128x4"
REL_TOL = G.REL_TOL
SKIPPED_EXPERT = -1  # the GPU mode marks the last expert's blocks as another rank's: their pairs must be zeros


@gluon.jit
def _ws_loader(a_desc, w_desc, ExpertIds, a_smem, w_smem, ready, empty, pid, nprog, num_n, total, my_tiles, n_k, N,
               E, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """The producer warps: every K step of the CTA's tiles into the ring, once the consumers released the stage's
    previous step (j - STAGES); across a tile's epilogue too, so the next tile's first STAGES steps are loaded
    while the consumers store."""
    for j in range(0, my_tiles * n_k):
        st = j % STAGES
        # a fresh barrier counts its phase before 0 (parity 1) as complete: the first round passes at once
        mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
        _down_load_step(j, n_k, pid, nprog, num_n, total, a_desc, w_desc, ExpertIds, a_smem, w_smem, ready, N, E,
                        BLOCK_M, BLOCK_N, BLOCK_K, STAGES)


@gluon.jit
def _ws_consumer(a_smem, w_smem, o_smem, ready, empty, SortedIds, ExpertIds, TopkWeights, Y, pid, nprog, num_n,
                 my_tiles, n_k, num_pairs, N, E, stride_yt, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):
    """The consumer warpgroups (the default partition): one wgmma a K step, one step in flight; a stage is
    released (one arrive, after a barrier of this partition's warps, so both warpgroups are past it) once the
    step that read it has retired; then each tile's epilogue."""
    NW: gl.constexpr = gl.num_warps()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    TPC: gl.constexpr = BLOCK_N // 8 if BLOCK_N // 8 < 32 else 32
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [NW, 1], [1, 0])
    it = 0
    for t in range(0, my_tiles):
        tile = pid + t * nprog
        pid_m = tile // num_n
        pid_n = tile - pid_m * num_n
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for kk in range(0, n_k):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(st), w_smem.index(st).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            _cta_barrier()  # (this partition's warps) both warpgroups have retired step it - 1
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > 0)  # the tile's first: done below
            it += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        _cta_barrier()  # both warpgroups have retired the tile's last step: its stage goes back before the epilogue
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))

        _down_store_tile(acc, o_smem, SortedIds, ExpertIds, TopkWeights, Y, pid_m, pid_n, num_pairs, N, E,
                         stride_yt, acc_layout, st_layout, BLOCK_M, BLOCK_N)
        _cta_barrier()  # every warp's reads of o_smem before the next tile's epilogue writes it


@gluon.jit(do_not_specialize=["num_pairs", "E"])
def _down_ws_kernel(a_desc, w_desc, SortedIds, ExpertIds, NumPadded, TopkWeights, Y, num_pairs, N, K, E,
                    stride_yt, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """_down_gluon_kernel warp-specialized: LOADER_WARPS producer warps (one thread issues the TMA) fill the
    ring, the BLOCK_M / 16 warps of the default partition multiply and store; hand-offs through mbarriers
    (ready: the TMA bytes; empty: the consumers' release), no CTA-wide barrier, prefetch distance the whole
    STAGES, and the loads run on through the epilogue."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW * 16 == BLOCK_M, "a warp a 16-row slice of the wgmma tile")
    dtype: gl.constexpr = Y.dtype.element_ty
    o_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_n = N // BLOCK_N
    total = gl.cdiv(gl.load(NumPadded), BLOCK_M) * num_n
    my_tiles = gl.maximum(gl.cdiv(total - pid, nprog), 0)
    n_k = gl.cdiv(K, BLOCK_K)

    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], o_sl)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_ws_consumer, (a_smem, w_smem, o_smem, ready, empty, SortedIds, ExpertIds, TopkWeights, Y, pid, nprog,
                        num_n, my_tiles, n_k, num_pairs, N, E, stride_yt, BLOCK_M, BLOCK_N, STAGES)),
        (_ws_loader, (a_desc, w_desc, ExpertIds, a_smem, w_smem, ready, empty, pid, nprog, num_n, total, my_tiles,
                      n_k, N, E, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
    ], [LOADER_WARPS], [LOADER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def launch_args(act, down_proj, sorted_ids, expert_ids, num_padded, topk_weights, y, block_m: int, variant: str,
                programs: int):
    """(grid, args, kwargs): the engine's (gluon_moe.down_launch_args) at the variant's tile and stages."""
    bn, stages = VARIANTS[variant][:2]
    grid, args, kwargs = down_launch_args(act, down_proj, sorted_ids, expert_ids, num_padded, topk_weights, y,
                                          block_m, bn, programs, stages=stages)
    if is_ws(variant):
        kwargs.update(LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS)
    return grid, args, kwargs


def is_ws(variant: str) -> bool:
    return VARIANTS[variant][2:] == ("ws",)


def kernel_of(variant: str):
    return _down_ws_kernel if is_ws(variant) else _down_gluon_kernel


def down_gluon(act, down_proj, sorted_ids, expert_ids, num_padded, topk_weights, y, block_m, variant):
    from compiled_llm.ops.triton.skinny_gemm import num_sms

    grid, args, kwargs = launch_args(act, down_proj, sorted_ids, expert_ids, num_padded, topk_weights, y, block_m,
                                     variant, num_sms(act.device))
    kernel_of(variant)[grid](*args, **kwargs)
    return y


# ---------------------------------------------------------------------------------------------------------------
# CPU: builds for sm_90a (compiled_llm/runtime/kernel_check.py's build, no GPU needed)

def build_sm90(variant: str, block_m: int = 128, T: int = 64):
    """The variant built for sm_90a on this machine, for Gemma 4's H and I (two experts: the expert count is only
    the descriptor's runtime shape)."""
    from compiled_llm.runtime.kernel_check import Launch, build_sm90 as build

    E, H, I, k = 2, GEMMA4["H"], GEMMA4["I"], GEMMA4["k"]
    rows = 4 * block_m
    act = torch.zeros(rows, I, dtype=torch.bfloat16)
    w = torch.zeros(E, H, I, dtype=torch.bfloat16)
    sorted_ids = torch.zeros(rows, dtype=torch.int32)
    expert_ids = torch.zeros(rows // block_m, dtype=torch.int32)
    wts = torch.zeros(T, k)
    y = torch.empty(T * k, H, dtype=torch.bfloat16)
    _, args, kwargs = launch_args(act, w, sorted_ids, expert_ids, torch.zeros(1, dtype=torch.int32), wts, y,
                                  block_m, variant, 132)
    return build(Launch(kernel_of(variant), args, kwargs))


def build_only(variants: list[str], block_ms: list[int]) -> int:
    return G.build_only(variants, block_ms, build=build_sm90)


# ---------------------------------------------------------------------------------------------------------------
# the inputs and the engine's launch (shared by the GPU mode and --dry-run)

def make_case(T: int, dev, S: dict, seed: int = 1, pol=None, align=None, skip_expert: bool = True,
              dtype=torch.bfloat16):
    """gluon_moe_gate_up's case (x, gate_up weights, top-k ids, the engine's alignment at its policy), with random
    down weights and random pick weights, and the engine's two calls on them (moe_launches): gate_up() is run
    once here so that act holds real activations; `engine` is the down() call. skip_expert: the last expert's
    blocks become another rank's (-1), whose pairs the down kernels must store as zeros. dtype: float32 for --smoke
    (the gate/up prototype's reason: the engine's kernels in the interpreter)."""
    from compiled_llm.ops.triton import moe as M

    # the baseline is the Triton down kernel, whatever COMPILED_LLM_MOE_GLUON_DOWN says
    pol = dataclasses.replace(pol or M.moe_launch_policy(T, S["k"], S["E"], S["H"], S["I"]), gluon_down=False)
    case = G.make_case(T, dev, S, seed=seed, pol=pol, align=align, dtype=dtype)  # (runs its gate/up once)
    expert_ids = case["alignment"][1]
    if skip_expert:
        expert_ids.masked_fill_(expert_ids == S["E"] - 1, SKIPPED_EXPERT)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    down = (torch.randn(S["E"], S["H"], S["I"], device=dev, generator=g) * S["I"] ** -0.5).to(dtype)
    wts = torch.rand(T, S["k"], device=dev, generator=g) + 0.5
    gate_up, engine_down = M.moe_launches(case["x"], case["w"], down, wts, case["ids"], policy=pol,
                                          alignment=case["alignment"])
    gate_up()
    act = G.engine_act(dict(engine=gate_up))
    return dict(case, down=down, wts=wts, act=act, engine=engine_down)


def reference_rows(case, pairs: torch.Tensor) -> torch.Tensor:
    """fp32 torch of y at the given pairs, from the engine's activations: w[p] * act[row of p] @ down[e].T (zero
    for a pair of a skipped block)."""
    sorted_ids, expert_ids, _ = case["alignment"]
    real = torch.nonzero(sorted_ids < case["T"] * case["S"]["k"]).flatten()
    row_of = torch.empty(case["T"] * case["S"]["k"], dtype=torch.long, device=real.device)
    row_of[sorted_ids[real].long()] = real
    rows = row_of[pairs.long()]
    e = expert_ids[rows // case["pol"].block_m].long()
    out = torch.zeros(pairs.numel(), case["S"]["H"], device=rows.device)
    for ex in e.unique().tolist():
        if ex < 0:
            continue
        sel = e == ex
        out[sel] = case["act"][rows[sel]].float() @ case["down"][ex].float().T
    return out * case["wts"].reshape(-1)[pairs.long()].float()[:, None]


def dry_run(tokens: list[int], variants: list[str]) -> int:
    """The GPU mode's host side on CPU tensors, cheaply: 16 experts and H 256 (Gemma 4's I and top-8), a tenth of
    the tokens, at the policy of the real token count; the alignment by torch (moe_align_sorted). The engine's
    and each variant's launches are recorded (as on an H100, 132 programs) and built for sm_90a."""
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
            y = torch.empty(small * S["k"], S["H"], dtype=torch.bfloat16)
            for v in variants:
                if S["H"] % VARIANTS[v][0] == 0:
                    down_gluon(case["act"], case["down"], sorted_ids, expert_ids, num_padded, case["wts"], y,
                               pol.block_m, v)
            n_pairs = small * S["k"]
            real = torch.nonzero(sorted_ids < n_pairs).flatten()
            case["act"].normal_()  # (recorded, the gate/up call wrote nothing: stand-in activations)
            ref = reference_rows(case, torch.randperm(n_pairs)[:64])
        skipped = int((expert_ids[:int(num_padded) // pol.block_m] == SKIPPED_EXPERT).sum())
        good = real.numel() == n_pairs and bool(torch.isfinite(ref).all()) and ref.abs().max() > 0.1
        ok &= good
        print(f"T={T} (on the CPU: {small} tokens, E {S['E']}, H {S['H']}): block_m {pol.block_m}, down tiles "
              f"{pol.b_block_n} (persistent {pol.persistent}), padded {int(num_padded)} rows in {expert_ids.numel()} "
              f"blocks ({skipped} skipped), fp32 reference of 64 pairs max {float(ref.abs().max()):.2f}"
              f"{'' if good else ' FAILED'}")
        ok &= G.build_recorded(launches, skip=("_gate_up_kernel",))  # (the gate/up prototype's dry run builds it)
    return G.finish_dry_run(ok, __file__, variants)


def torch_down(act, down_proj, sorted_ids, expert_ids, num_padded, topk_weights, y, block_m, variant):
    """down_gluon's semantics in torch, block by block (--smoke's stand-in for the Gluon kernel, which has no
    interpreter): real pairs written, zeros for a skipped block's."""
    n = y.shape[0]
    for b in range(int(num_padded) // block_m):
        e = int(expert_ids[b])
        rows = torch.arange(b * block_m, (b + 1) * block_m, device=act.device)
        pair = sorted_ids[rows].long()
        real = pair < n
        pair = pair[real]
        if e < 0:
            y[pair] = 0
            continue
        h = act[rows[real]].float() @ down_proj[e].float().T
        y[pair] = (h * topk_weights.reshape(-1)[pair].float()[:, None]).to(y.dtype)
    return y


def smoke(variants: list[str]) -> int:
    """The GPU mode's code on the CPU (TRITON_INTERPRET=1, set at import; Triton 3.7+): 8 experts, H 256, I 64,
    fp32, the engine's kernels in the interpreter, the Gluon variants stood in by torch_down: the checks, the
    timing calls and the table run as on the GPU. 40 tokens take the 64-row tier, 160 the 128-row one, 320 the
    persistent down kernel's."""
    global down_gluon
    down_gluon = torch_down
    return gpu_main([40, 160, 320], variants, False, dev=torch.device("cpu"), S=dict(GEMMA4, E=8, H=256, I=64),
                    dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# GPU: check and timing

def _hung(T: int, variant: str) -> None:
    print(f"T={T} {variant}: no result after {G.HANG_S} s, the build included: a hang (a pipeline barrier's bug?); "
          f"exiting: rerun without it", flush=True)
    os._exit(3)


def gpu_main(tokens: list[int], variants: list[str], check_only: bool, dev=None, S: dict = GEMMA4,
             dtype=torch.bfloat16) -> int:
    """dev, S, dtype: another device and shapes (--smoke: this code on the CPU, the Gluon kernel stood in for)."""
    from graph_timing import kernel_timer

    dev = dev or torch.device("cuda")
    time_fn = kernel_timer(dev.type != "cuda", calls=5, replays=10)
    ok, rows = True, []
    for T in tokens:
        case = make_case(T, dev, S, seed=T, dtype=dtype)
        sorted_ids, expert_ids, num_padded = case["alignment"]
        pol, bm, num_pairs = case["pol"], case["pol"].block_m, T * S["k"]
        ref_y = case["engine"]().clone()  # (the engine's y buffer is reused by its later calls)
        G._sync(dev)
        sample = torch.randperm(num_pairs, device=dev)[:512]
        ref32 = reference_rows(case, sample)
        scale = float(ref_y.float().abs().max())
        e_err = float((ref_y[sample].float() - ref32).abs().max()) / float(ref32.abs().max())
        ok &= e_err < REL_TOL  # the check of the check: the engine's output, as this file reads it, matches fp32
        skipped = int((expert_ids[:int(num_padded) // bm] == SKIPPED_EXPERT).sum())
        print(f"T={T}: block_m {bm}, engine down tiles {pol.b_block_n} x {pol.b_block_k} (persistent "
              f"{pol.persistent}), {expert_ids.numel()} row blocks ({skipped} skipped), padded {int(num_padded)} "
              f"rows; engine vs fp32 on {sample.numel()} pairs {e_err:.2e} of max |ref|"
              f"{'' if e_err < REL_TOL else ' FAIL'}", flush=True)
        flops = 2.0 * num_pairs * S["H"] * S["I"]
        row = dict(T=T, flops=flops, engine=None if check_only else time_fn(case["engine"]))
        if row["engine"]:
            print(f"T={T} engine: {row['engine']:.1f} us ({flops / row['engine'] / 1e6:.0f} TFLOP/s)", flush=True)
        inputs = (case["act"], case["down"], sorted_ids, expert_ids, num_padded, case["wts"])
        for v in variants:
            y = torch.full_like(ref_y, float("nan"))  # pairs the kernel misses show up as NaN in the check
            try:
                # a pipeline barrier's bug hangs the GPU, not Python: past HANG_S the process names the variant
                watchdog = threading.Timer(G.HANG_S, _hung, (T, v))
                watchdog.start()
                try:
                    down_gluon(*inputs, y, bm, v)
                    G._sync(dev)  # (torch.cuda.synchronize releases the GIL: the watchdog's thread runs meanwhile)
                finally:
                    watchdog.cancel()
                d_eng = float((y.float() - ref_y.float()).abs().max()) / scale
                d_ref = float((y[sample].float() - ref32).abs().max()) / float(ref32.abs().max())
                good = d_eng < REL_TOL and d_ref < REL_TOL and bool(torch.isfinite(y).all())
            except Exception as exc:  # noqa: BLE001 - a build or launch failure is reported, the others still run
                print(f"T={T} {v}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                ok, row[v] = False, None
                continue
            ok &= good
            print(f"T={T} {v}: max |gluon - engine| / max |engine| {d_eng:.2e} over the {num_pairs} pairs, vs fp32 "
                  f"{d_ref:.2e} on {sample.numel()} ({'ok' if good else f'FAIL: over {REL_TOL}'})", flush=True)
            if good and not check_only:
                try:
                    row[v] = time_fn(lambda: down_gluon(*inputs, y, bm, v))
                    print(f"T={T} {v}: {row[v]:.1f} us ({flops / row[v] / 1e6:.0f} TFLOP/s)", flush=True)
                except Exception as exc:  # noqa: BLE001 - e.g. a capture failure: reported, the others still run
                    print(f"T={T} {v}: timing failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                    ok = False
        rows.append(row)
    if not check_only:
        G.print_table(dev, rows, variants, "2 * pairs * H * I", [
            "engine: moe_launches' down() (the policy's _down_kernel / _down_persistent_kernel); variants:",
            "p<BLOCK_N>x<STAGES> persistent, one partition; w = the same warp-specialized (TMA loader warps);",
            "the policy's row blocks (128 from 2,048 tokens on); CUDA-graph replays, 5 calls a graph, 10 replays"])
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(G.cli(sys.modules[__name__], "2048,4096,8192", "128"))
