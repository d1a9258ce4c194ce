#!/usr/bin/env python
"""Check and time the Triton kernels of compiled_llm/ops/triton on one GPU (written for an H200).

Correctness: random bf16 inputs at Gemma 4 26B-A4B shapes, compared with the fp32 PyTorch references
(compiled_llm.ops.attention.reference_attention; gemma4.Router / gemma4.Experts). Prints max error per case.
Timing: triton.testing.do_bench_cudagraph (falls back to do_bench) for the kernel and a PyTorch baseline
(gather + SDPA for attention, the gemma4 modules for the MoE path). Ends with one PASS/FAIL line.

    python scripts/check_kernels_gpu.py            # everything, ~2-4 min
    python scripts/check_kernels_gpu.py --no-time  # correctness only
    python scripts/check_kernels_gpu.py --only decode,moe
    python scripts/check_kernels_gpu.py --smoke    # CPU, Triton interpreter, tiny shapes: tests the script
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiled_llm.models.gemma4 import Experts, Router  # noqa: E402
from compiled_llm.ops import attention as A  # noqa: E402
from compiled_llm.ops import context as C  # noqa: E402
from compiled_llm.ops.rope import apply_rope, rope_inv_freq  # noqa: E402
from compiled_llm.ops.triton import _common  # noqa: E402
from compiled_llm.ops.triton import moe as M  # noqa: E402
from compiled_llm.ops.triton import paged_attention as PA  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
PAGE = 16
RESULTS: list[tuple[str, bool]] = []
TABLE: list[tuple[str, str, float, float, str]] = []
TUNE: list[tuple[str, str, float, str]] = []
ARGS = None

# Gemma 4 26B-A4B
HQ = 16
SLIDING = dict(kv_heads=8, head_dim=256, window=1024, k_eq_v=False)
GLOBAL = dict(kv_heads=2, head_dim=512, window=None, k_eq_v=True)
E, TOPK, H, I = 128, 8, 2816, 704


def S_(xs):
    return [sz(x) for x in xs]


def sz(n):
    """Context/token counts: real sizes on the GPU, shrunk (monotonically) in --smoke mode."""
    return n if not ARGS.smoke else max(1, min(n, 3 + n // 400))


def log(msg):
    print(msg, flush=True)


def record(name, err, tol):
    ok = math.isfinite(err) and err <= tol
    RESULTS.append((name, ok))
    log(f"  {'ok  ' if ok else 'FAIL'} {name:<72} max err {err:.3e} (tol {tol:.1e})")


def bench(fn, graph=True):
    """ms per call; CUDA-graph replay when the function is capturable (no host syncs)."""
    if ARGS.smoke:  # exercise the code path only
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=30)
        except Exception:
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=30)


def timed(kernel, shape, fn, base_fn, work_bytes=None, flops=None, base_graph=True):
    if ARGS.no_time:
        return
    try:
        ms = bench(fn)
        base = bench(base_fn, graph=base_graph) if base_fn is not None else float("nan")
    except Exception as e:  # timing must never hide the correctness summary
        log(f"  timing {kernel} {shape} failed: {type(e).__name__}: {str(e)[:200]}")
        return
    rate = ""
    if work_bytes:
        rate = f"{work_bytes / ms / 1e6:.0f} GB/s"
    if flops:
        rate += ("  " if rate else "") + f"{flops / ms / 1e9:.1f} TFLOP/s"
    TABLE.append((kernel, shape, ms, base, rate))


# ------------------------------------------------------------------------------------------------------
# attention


def make_attn_case(seq_lens, q_lens, *, kv_heads, head_dim, window, k_eq_v, seed=0):
    """bf16 paged cache with shuffled blocks; blocks wholly outside every query's window are released (-1)
    and NaN-filled, as are the unused slots of each sequence's first/last block."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    nblk = [triton.cdiv(L, PAGE) for L in seq_lens]
    total = sum(nblk)
    perm = torch.randperm(total, device=DEV, generator=g)
    bt = torch.full((len(seq_lens), max(nblk) + 2), -1, dtype=torch.int32, device=DEV)
    cache = torch.randn((1 if k_eq_v else 2, total, PAGE, kv_heads, head_dim), device=DEV, dtype=BF16, generator=g)
    flat = cache.view(cache.shape[0], total * PAGE, kv_heads, head_dim)
    off = 0
    for i, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        blocks = perm[off:off + nblk[i]]
        off += nblk[i]
        bt[i, :nblk[i]] = blocks.int()
        first = 0 if window is None else max(0, L - ql - window + 1)
        dead = first // PAGE
        if dead:
            cache[:, blocks[:dead].long()] = float("nan")
            bt[i, :dead] = -1
        b0 = int(blocks[dead]) if dead < nblk[i] else None
        if b0 is not None and first % PAGE:
            flat[:, b0 * PAGE: b0 * PAGE + first % PAGE] = float("nan")
        if L % PAGE:
            b1 = int(blocks[-1])
            flat[:, b1 * PAGE + L % PAGE: (b1 + 1) * PAGE] = float("nan")
    q = torch.randn(sum(q_lens), HQ, head_dim, device=DEV, dtype=BF16, generator=g)
    extra = {}
    if k_eq_v:
        extra["k_norm_weight"] = (1.0 + 0.2 * torch.randn(head_dim, device=DEV, generator=g)).to(BF16)
        extra["inv_freq"] = rope_inv_freq(head_dim, 1e6, "proportional", partial_rotary_factor=0.25).to(DEV)
    return q, cache, bt, extra


def attn_reference(q, cache, bt, seq_lens, q_lens, *, kv_heads, head_dim, window, k_eq_v, scale, softcap,
                   k_norm_weight=None, inv_freq=None):
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    kw = dict(num_heads=HQ, num_kv_heads=kv_heads, head_dim=head_dim, sliding_window=window, cache_layer=0,
              scale=scale, softcap=softcap)
    src = A.AttentionSpec(layer_idx=0, k_eq_v=k_eq_v, inv_freq=inv_freq,
                          k_norm_weight=None if k_norm_weight is None else k_norm_weight.float(), **kw)
    spec = A.AttentionSpec(layer_idx=1, **kw)
    meta = C.AttentionMetadata(query_start_loc=qsl, seq_lens=list(seq_lens), block_size=PAGE,
                               groups={window: C.GroupMetadata(block_tables=bt, slot_mapping=torch.empty(0))})
    ctx = C.ForwardContext(attn_metadata=meta, kv_caches={0: torch.nan_to_num(cache.float())}, layers={0: src, 1: spec})
    with C.set_forward_context(ctx):
        out = A.reference_attention(q.float().reshape(q.shape[0], -1), None, None, 1)
    return out.view(q.shape)


GLUON_CALLS = [0]  # paged_prefill's launches of the Gluon d512 kernel (ops/triton/gluon_prefill.py), counted


def _counted(fn):
    def call(*args, **kwargs):
        GLUON_CALLS[0] += 1
        return fn(*args, **kwargs)
    return call


PA.gluon_prefill.prefill_d512 = _counted(PA.gluon_prefill.prefill_d512)


def attn_check(mode, seq_lens, q_lens, layer, softcap=None, seed=0):
    cfg = dict(layer)
    calls = GLUON_CALLS[0]
    q, cache, bt, extra = make_attn_case(seq_lens, q_lens, seed=seed, **cfg)
    scale = cfg["head_dim"] ** -0.5
    opts = dict(scale=scale, sliding_window=cfg["window"], softcap=softcap, k_eq_v=cfg["k_eq_v"],
                num_kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"], **extra)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    if mode == "decode":
        out = PA.paged_decode(q, cache, bt, sl, **opts)
    else:
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        out = PA.paged_prefill(q, cache, bt, qsl, sl, **opts)
    ref = attn_reference(q, cache, bt, seq_lens, q_lens, scale=scale, softcap=softcap, **cfg, **extra)
    err = (out.float() - ref).abs().max().item()
    if not torch.isfinite(out).all():
        err = float("inf")
    name = (f"{mode} d={cfg['head_dim']} kv={cfg['kv_heads']} W={cfg['window']} kv=v:{int(cfg['k_eq_v'])} "
            f"cap={softcap} lens={_short(seq_lens)}" + (f" q={_short(q_lens)}" if mode == "prefill" else "")
            + (" (gluon)" if GLUON_CALLS[0] > calls else ""))
    record(name, err, 2e-2 * max(1.0, ref.abs().max().item()))


def _short(xs):
    return str(xs) if len(xs) <= 5 else f"[{xs[0]},{xs[1]},..x{len(xs)}]"


def _gather_dense(cache, bt, L, layer, extra):
    """PyTorch baseline: gather the visible context of equal-length sequences, rebuild K for K=V layers."""
    first = 0 if layer["window"] is None else max(0, L - layer["window"])
    pos = torch.arange(first, L, device=DEV)
    slots = bt[:, pos // PAGE].long() * PAGE + pos % PAGE  # [S, n]
    flat = cache.view(cache.shape[0], -1, layer["kv_heads"], layer["head_dim"])
    v = flat[-1][slots]  # [S, n, Hkv, D]
    if layer["k_eq_v"]:
        k = (v * extra["k_norm_weight"]).flatten(0, 1)
        k = apply_rope(k, pos.repeat(bt.shape[0]), extra["inv_freq"]).view(v.shape)
    else:
        k = flat[0][slots]
    return k.transpose(1, 2), v.transpose(1, 2), pos


def attn_time_decode(num_seqs, L, layer, name):
    if ARGS.smoke:
        num_seqs, L = min(num_seqs, 3), sz(L)
    cfg = dict(layer)
    q, cache, bt, extra = make_attn_case([L] * num_seqs, [1] * num_seqs, seed=1, **cfg)
    cache = torch.nan_to_num(cache)
    sl = torch.full((num_seqs,), L, dtype=torch.int32, device=DEV)
    scale = cfg["head_dim"] ** -0.5
    opts = dict(scale=scale, sliding_window=cfg["window"], k_eq_v=cfg["k_eq_v"], num_kv_heads=cfg["kv_heads"],
                head_dim=cfg["head_dim"], **extra)

    def base():
        k, v, _ = _gather_dense(cache, bt, L, cfg, extra)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    n = L if cfg["window"] is None else min(L, cfg["window"])
    nbytes = num_seqs * n * cfg["kv_heads"] * cfg["head_dim"] * 2 * (1 if cfg["k_eq_v"] else 2)
    pol = PA.attention_launch_policy(num_seqs, bt.shape[1] * PAGE, cfg["head_dim"], num_kv_heads=cfg["kv_heads"],
                                     sliding_window=cfg["window"], k_eq_v=cfg["k_eq_v"])
    timed(name, f"S={num_seqs} ctx={L} splits={pol.num_splits}",
          lambda: PA.paged_decode(q, cache, bt, sl, **opts), base, work_bytes=nbytes)


def attn_time_prefill(L, layer, name):
    L = sz(L)
    cfg = dict(layer)
    q, cache, bt, extra = make_attn_case([L], [L], seed=2, **cfg)
    cache = torch.nan_to_num(cache)
    sl = torch.tensor([L], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, L], dtype=torch.int32, device=DEV)
    scale = cfg["head_dim"] ** -0.5
    opts = dict(scale=scale, sliding_window=cfg["window"], k_eq_v=cfg["k_eq_v"], num_kv_heads=cfg["kv_heads"],
                head_dim=cfg["head_dim"], **extra)
    W = cfg["window"]
    pos = torch.arange(L, device=DEV)
    mask = None
    if W is not None:
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - W)

    def base():
        k, v, _ = _gather_dense(cache, bt, L, dict(cfg, window=None), extra)
        qq = q.transpose(0, 1)[None]
        if mask is None:
            return F.scaled_dot_product_attention(qq, k, v, scale=scale, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    pairs = sum(min(p + 1, W or p + 1) for p in range(L))
    timed(name, f"tokens={L}", lambda: PA.paged_prefill(q, cache, bt, qsl, sl, **opts), base,
          flops=4.0 * HQ * cfg["head_dim"] * pairs)


def run_decode():
    log("[decode]")
    attn_check("decode", S_([1, 17, 1000, 4097, 32768]), [1] * 5, GLOBAL)
    attn_check("decode", S_([1, 500, 1023, 1024, 1025, 5000, 32768]), [1] * 7, SLIDING)
    attn_check("decode", S_([3000, 77, 9000]), [1] * 3, GLOBAL, softcap=50.0, seed=3)
    attn_check("decode", S_([2048, 31, 20000]), [1] * 3, dict(SLIDING, kv_heads=2), softcap=30.0, seed=4)  # GQA 8, d256
    attn_check("decode", S_([700, 12345]), [1] * 2, dict(GLOBAL, kv_heads=8, k_eq_v=False), seed=5)  # GQA 2, d512, K!=V
    lens = S_(torch.randint(1, 8192, (64,), generator=torch.Generator().manual_seed(6)).tolist())
    attn_check("decode", lens, [1] * 64, GLOBAL, seed=6)
    attn_check("decode", lens, [1] * 64, SLIDING, seed=7)
    for S, L in [(1, 4096), (1, 32768), (32, 4096), (128, 4096), (32, 32768)]:
        attn_time_decode(S, L, GLOBAL, "decode global d512 K=V")
    for S, L in [(1, 32768), (32, 4096), (128, 8192)]:
        attn_time_decode(S, L, SLIDING, "decode sliding d256")


def run_prefill():
    log("[prefill]")
    attn_check("prefill", S_([1, 4000, 512, 3000]), S_([1, 37, 512, 2000]), GLOBAL)
    attn_check("prefill", S_([5000, 3000, 1100]), S_([700, 3000, 100]), SLIDING)
    attn_check("prefill", S_([2500, 130]), S_([300, 130]), GLOBAL, softcap=50.0, seed=3)
    attn_check("prefill", S_([1500, 4100]), S_([1500, 999]), dict(SLIDING, kv_heads=2), softcap=30.0, seed=4)
    attn_check("prefill", S_([900]), S_([900]), dict(GLOBAL, kv_heads=8, k_eq_v=False), seed=5)
    # the Gluon kernel (GLOBAL without a soft-cap on sm_90): a whole 4K prompt, and 4-head groups with a prefix
    attn_check("prefill", S_([4100]), S_([4100]), GLOBAL, seed=6)
    attn_check("prefill", S_([700, 33, 1500, 64]), S_([700, 9, 1, 64]), dict(GLOBAL, kv_heads=4), seed=7)
    for L in [2048, 8192]:
        attn_time_prefill(L, GLOBAL, "prefill global d512 K=V")
        attn_time_prefill(L, SLIDING, "prefill sliding d256")


def run_logits():
    """The soft cap of the final logits (ops/triton/logits.py) against eager PyTorch's three launches, at the
    LM head's decode shape: the same roundings, so equal but for tanh's last bit (reported: how many differ)."""
    log("[logits]")
    from compiled_llm.ops.logits import ref_logits_softcap
    from compiled_llm.ops.triton.logits import logits_softcap

    vocab = 262144 if not ARGS.smoke else 3000
    for dtype in dict.fromkeys((BF16, torch.float32)):
        x = (torch.randn(8, vocab, device=DEV, generator=torch.Generator(device=DEV).manual_seed(9)) * 20).to(dtype)
        got, ref = logits_softcap(x, 30.0), ref_logits_softcap(x, 30.0)
        diff = (got - ref).abs()
        frac = (diff > 0).float().mean().item()
        tol = 30.0 * 2.0 ** -7 if dtype != torch.float32 else 1e-5  # one ulp of the output's dtype at the cap
        record(f"logits_softcap {str(dtype)[6:]} 8 x {vocab} ({frac:.2e} of values differ)", diff.max().item(), tol)
        if not ARGS.no_time:
            timed("logits_softcap", f"8 x {vocab} {str(dtype)[6:]}", lambda: logits_softcap(x, 30.0),
                  lambda: ref_logits_softcap(x, 30.0), work_bytes=x.numel() * (x.element_size() + 4))
            if dtype == BF16:  # other launches of the same kernel (the base column: the default one)
                for block, warps in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)):
                    timed("logits_softcap", f"8 x {vocab} bf16 block {block} w{warps}",
                          lambda b=block, w=warps: logits_softcap(x, 30.0, block=b, warps=w),
                          lambda: logits_softcap(x, 30.0), work_bytes=x.numel() * (x.element_size() + 4))
    # the greedy rows' argmax (ops/logits.py argmax_rows) against torch.argmax: equal indices, ties and NaN included
    from compiled_llm.ops.triton.logits import argmax_rows

    g = torch.Generator(device=DEV).manual_seed(10)
    x = torch.tanh(torch.randn(8, vocab, device=DEV, generator=g)) * 30.0
    x[1, [5, vocab // 2, vocab - 1]] = 99.0  # a tie across chunks
    x[2] = float("-inf")
    x[3, [vocab // 3, vocab - 2]] = float("nan")
    x[4, :] = 7.0
    got, ref = argmax_rows(x), x.argmax(dim=-1)
    record(f"argmax_rows 8 x {vocab} (rows differing: {int((got != ref).sum())})", float((got != ref).sum()), 0.0)
    if not ARGS.no_time:
        y = torch.randn(8, vocab, device=DEV, generator=g)
        timed("argmax_rows", f"8 x {vocab} f32", lambda: argmax_rows(y), lambda: y.argmax(dim=-1),
              work_bytes=y.numel() * 4)
        for chunk, warps in ((2048, 4), (4096, 4), (8192, 8), (16384, 8), (16384, 16)):
            timed("argmax_rows", f"8 x {vocab} chunk {chunk} w{warps}",
                  lambda c=chunk, w=warps: argmax_rows(y, chunk=c, warps=w), lambda: y.argmax(dim=-1),
                  work_bytes=y.numel() * 4)


# ------------------------------------------------------------------------------------------------------
# MoE


def moe_modules(seed=0):
    torch.manual_seed(seed)
    cfg = SimpleNamespace(num_experts=E, moe_intermediate_size=I, hidden_size=H, top_k_experts=TOPK,
                          rms_norm_eps=1e-6)
    experts, router = Experts(cfg).to(DEV), Router(cfg).to(DEV)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, H ** -0.5)
        experts.down_proj.normal_(0, I ** -0.5)
        router.proj.weight.normal_(0, 1.0)
        router.scale.uniform_(0.5, 1.5)
        router.per_expert_scale.uniform_(0.5, 1.5)
    bf_experts = Experts(cfg).to(DEV)
    bf_router = Router(cfg).to(DEV)
    bf_experts.load_state_dict(experts.state_dict())
    bf_router.load_state_dict(router.state_dict())
    bf_experts, bf_router = bf_experts.to(BF16), bf_router.to(BF16)
    # fp32 references see exactly the bf16 weights
    experts.load_state_dict({k: v.float() for k, v in bf_experts.state_dict().items()})
    router.load_state_dict({k: v.float() for k, v in bf_router.state_dict().items()})
    return experts, router, bf_experts, bf_router


@torch.no_grad()
def run_moe():
    log("[moe]")
    experts, router, bf_experts, bf_router = moe_modules()
    gu, dn = bf_experts.gate_up_proj.data, bf_experts.down_proj.data
    x0 = torch.randn(8192, H, device=DEV, dtype=BF16)
    # gelu helper
    xs = torch.linspace(-12, 12, 100001, device=DEV)
    record("gelu_tanh fp32", (_common.gelu_tanh(xs) - F.gelu(xs, approximate="tanh")).abs().max().item(), 1e-5)
    for T in [1, 3, 8, 33, 64, 256, 1000, 2048, 8192]:
        T = sz(T) if ARGS.smoke else T
        x = x0[:T]
        w, ids = bf_router(x)
        w = w.float()
        out = M.fused_geglu_moe(x, gu, dn, w, ids)
        if T <= 2048 or not ARGS.quick:
            ref = experts(x.float(), w, ids)
            err = (out.float() - ref).abs().max().item()
            record(f"moe T={T} E={E} k={TOPK} H={H} I={I}", err, 3e-2 * max(1.0, ref.abs().max().item()))
        if T in (1, 8, 64, 256, 2048, 8192):
            pol = M.moe_launch_policy(T, TOPK, E, H, I)
            n_exp = int(ids.unique().numel())
            timed("fused_geglu_moe", f"T={T} bm={pol.block_m}", lambda: M.fused_geglu_moe(x, gu, dn, w, ids),
                  lambda: bf_experts(x, w, ids), work_bytes=n_exp * 3 * H * I * 2, flops=6.0 * T * TOPK * H * I,
                  base_graph=False)  # the module loop syncs on ids.unique()
    # router
    g = torch.Generator(device=DEV).manual_seed(1)
    for T in [1, 7, 64, 1000, 8192]:
        T = sz(T) if ARGS.smoke else T
        x = torch.randn(T, H, device=DEV, dtype=BF16, generator=g) * 2
        w, ids = M.fused_router_topk(x, bf_router.scale, bf_router.proj.weight, bf_router.per_expert_scale, TOPK,
                                     bf_router.eps)
        ref_w, ref_ids = router(x.float())
        ids_s, o1 = ids.long().sort(1)
        ref_s, o2 = ref_ids.sort(1)
        same = (ids_s == ref_s).all(1)
        frac = same.float().mean().item()
        w_s, ref_ws = w.gather(1, o1), ref_w.gather(1, o2)
        err = (w_s[same] - ref_ws[same]).abs().max().item() if same.any() else float("inf")
        # near-ties at the k-th expert may flip under bf16 rounding; demand >= 98% identical sets
        record(f"router T={T} E={E} k={TOPK} (same ids {frac * 100:.1f}%)", err if frac >= 0.98 else float("inf"),
               2e-2)
        if T in (1, 64, 8192):
            timed("fused_router_topk", f"T={T}",
                  lambda: M.fused_router_topk(x, bf_router.scale, bf_router.proj.weight, bf_router.per_expert_scale,
                                              TOPK, bf_router.norm.eps),
                  lambda: bf_router(x), work_bytes=x.numel() * 2 + E * H * 2)


# ------------------------------------------------------------------------------------------------------
# launch-policy candidates: time alternatives to the default at one shape each (output vs default shown)


def tune_row(kernel, config, fn, ref):
    try:
        out = fn()
        diff = f"{(out.float() - ref.float()).abs().max().item():.1e}"
        ms = bench(fn)
    except Exception as e:
        ms, diff = float("nan"), f"{type(e).__name__}: {str(e)[:60]}"
    TUNE.append((kernel, config, ms, diff))


def _pol(p):
    return f"splits={p.num_splits} bm={p.block_m} bn={p.block_n} w={p.num_warps} st={p.num_stages}"


def decode_case(layer, S, L, seed):
    """S decode rows at context L for a layer kind: inputs, the kernel's options, the default policy and its
    output (the reference the tuning candidates are compared with)."""
    q, cache, bt, extra = make_attn_case([L] * S, [1] * S, seed=seed, **layer)
    cache = torch.nan_to_num(cache)
    sl = torch.full((S,), L, dtype=torch.int32, device=DEV)
    opts = dict(scale=layer["head_dim"] ** -0.5, sliding_window=layer["window"], k_eq_v=layer["k_eq_v"],
                num_kv_heads=layer["kv_heads"], head_dim=layer["head_dim"], **extra)
    p0 = PA.attention_launch_policy(S, bt.shape[1] * PAGE, layer["head_dim"], num_kv_heads=layer["kv_heads"],
                                    sliding_window=layer["window"], k_eq_v=layer["k_eq_v"])
    return q, cache, bt, sl, opts, p0, PA.paged_decode(q, cache, bt, sl, policy=p0, **opts)


@torch.no_grad()
def run_tune():
    log("[tune]")
    R = dataclasses.replace
    for name, layer, S, L in [("decode global", GLOBAL, 32, 8192), ("decode sliding", SLIDING, 32, 4096)]:
        S, L = (min(S, 3), sz(L)) if ARGS.smoke else (S, L)
        q, cache, bt, sl, opts, p0, ref = decode_case(layer, S, L, seed=9)
        cands = [p0, R(p0, num_splits=p0.num_splits * 2), R(p0, num_stages=2), R(p0, num_warps=8),
                 R(p0, block_n=p0.block_n * 2), R(p0, block_n=p0.block_n * 2, num_warps=8)]
        for i, p in enumerate(cands):
            tune_row(f"{name} S={S} ctx={L}", _pol(p) + (" (default)" if i == 0 else ""),
                     lambda p=p: PA.paged_decode(q, cache, bt, sl, policy=p, **opts), ref)
    for name, layer, L in [("prefill global", GLOBAL, 8192), ("prefill sliding", SLIDING, 8192)]:
        L = sz(L)
        q, cache, bt, extra = make_attn_case([L], [L], seed=10, **layer)
        cache = torch.nan_to_num(cache)
        sl = torch.tensor([L], dtype=torch.int32, device=DEV)
        qsl = torch.tensor([0, L], dtype=torch.int32, device=DEV)
        opts = dict(scale=layer["head_dim"] ** -0.5, sliding_window=layer["window"], k_eq_v=layer["k_eq_v"],
                    num_kv_heads=layer["kv_heads"], head_dim=layer["head_dim"], **extra)
        p0 = PA.attention_launch_policy(1, L, layer["head_dim"], prefill=True)
        ref = PA.paged_prefill(q, cache, bt, qsl, sl, policy=p0, **opts)
        if layer["head_dim"] >= 512:
            cands = [p0, R(p0, block_m=64, num_stages=2), R(p0, block_m=64), R(p0, block_n=64, num_stages=2),
                     R(p0, num_warps=4)]
        else:
            cands = [p0, R(p0, block_m=128, num_warps=8), R(p0, block_n=64, num_stages=2),
                     R(p0, block_m=128, block_n=64, num_warps=8, num_stages=2)]
        for i, p in enumerate(cands):
            tune_row(f"{name} tokens={L}", _pol(p) + (" (default)" if i == 0 else ""),
                     lambda p=p: PA.paged_prefill(q, cache, bt, qsl, sl, policy=p, **opts), ref)
    _, _, bf_experts, bf_router = moe_modules()
    gu, dn = bf_experts.gate_up_proj.data, bf_experts.down_proj.data
    for T, alts in [(1, [(16, 64, 128, 4, 4, 128, 128, 4, 4), (16, 16, 256, 4, 4, 32, 256, 4, 4)]),
                    (64, [(16, 32, 128, 4, 4, 64, 128, 4, 4), (32, 64, 128, 4, 4, 128, 128, 4, 3)]),
                    (8192, [(128, 128, 64, 8, 3, 128, 64, 8, 4), (64, 128, 64, 8, 3, 256, 64, 8, 3),
                            (128, 64, 64, 8, 4, 128, 64, 8, 4)])]:
        T = sz(T)
        x = torch.randn(T, H, device=DEV, dtype=BF16)
        w, ids = bf_router(x)
        w = w.float()
        p0 = M.moe_launch_policy(T, TOPK, E, H, I)
        ref = M.fused_geglu_moe(x, gu, dn, w, ids, policy=p0)
        for i, p in enumerate([p0] + [M.MoELaunch(*a) for a in alts]):
            cfg = "bm={} a:bn={} bk={} w={} st={} b:bn={} bk={} w={} st={}".format(*dataclasses.astuple(p))
            tune_row(f"moe T={T}", cfg + (" (default)" if i == 0 else ""),
                     lambda p=p: M.fused_geglu_moe(x, gu, dn, w, ids, policy=p), ref)


@torch.no_grad()
def run_decode_small():
    """Split count and tile sweep for decode at the batch sizes serving runs (1 and 8 sequences) and the
    context lengths of the benchmarks: what attention_launch_policy should pick (issue 14, batch 1)."""
    log("[decode_small]")
    R = dataclasses.replace
    for name, layer in [("global", GLOBAL), ("sliding", SLIDING)]:
        for S, L in [(1, 1100), (8, 1100), (1, 8300), (8, 4400)]:
            S, L = (min(S, 3), sz(L)) if ARGS.smoke else (S, L)
            q, cache, bt, sl, opts, p0, ref = decode_case(layer, S, L, seed=11)
            cands = [p0] + [R(p0, num_splits=n) for n in (2, 4, 8, 16, 32, 64) if n != p0.num_splits]
            cands += [R(p0, num_splits=n, num_warps=w, num_stages=st, block_n=bn) for n in (8, 16, 32)
                      for bn in {p0.block_n, 2 * p0.block_n} for w in (4, 8) for st in (2, 3)
                      if (bn, w, st) != (p0.block_n, p0.num_warps, p0.num_stages)]
            for i, p in enumerate(cands[:3] if ARGS.smoke else cands):
                tune_row(f"decode {name} S={S} ctx={L}", _pol(p) + (" (default)" if i == 0 else ""),
                         lambda p=p: PA.paged_decode(q, cache, bt, sl, policy=p, **opts), ref)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--quick", action="store_true", help="skip the largest fp32 references")
    ap.add_argument("--only", default="decode,prefill,moe,tune,logits")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter at tiny shapes (fp32)")
    ap.add_argument("--smoke-time", action="store_true", help="with --smoke: also run the timing code paths")
    ARGS = ap.parse_args()
    if ARGS.smoke:
        global DEV, BF16, SLIDING, GLOBAL, E, TOPK, H, I
        DEV, BF16, ARGS.no_time = "cpu", torch.float32, not ARGS.smoke_time
        SLIDING = dict(kv_heads=8, head_dim=32, window=5, k_eq_v=False)
        GLOBAL = dict(kv_heads=2, head_dim=64, window=None, k_eq_v=True)
        E, TOPK, H, I = 8, 2, 64, 48
        torch.set_num_threads(2)
        log("smoke mode: CPU, Triton interpreter, tiny shapes")
    else:
        assert torch.cuda.is_available(), "needs a GPU"
        log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.time()
    groups = {"decode": run_decode, "prefill": run_prefill, "moe": run_moe, "tune": run_tune,
              "decode_small": run_decode_small, "logits": run_logits}
    if ARGS.no_time:
        groups.pop("tune")
    for name in ARGS.only.split(","):
        if name not in groups:
            continue
        t = time.time()
        try:
            groups[name]()
        except Exception:
            traceback.print_exc()
            RESULTS.append((f"{name}: exception", False))
        log(f"[{name}] {time.time() - t:.1f}s")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if TABLE:
        log("")
        log(f"{'kernel':<26} {'shape':<28} {'ms':>9} {'torch ms':>9} {'speedup':>8}  achieved")
        for kernel, shape, ms, base, rate in TABLE:
            log(f"{kernel:<26} {shape:<28} {ms:9.4f} {base:9.4f} {base / ms:7.2f}x  {rate}")
    if TUNE:
        log("")
        log(f"{'policy candidates':<34} {'config':<58} {'ms':>9}  max diff vs default")
        for kernel, cfg, ms, diff in TUNE:
            log(f"{kernel:<34} {cfg:<58} {ms:9.4f}  {diff}")
        log("")
        log("best per case (default -> best):")
        for kernel in dict.fromkeys(k for k, *_ in TUNE):
            rows = [(ms, cfg) for k, cfg, ms, _ in TUNE if k == kernel and ms == ms]
            default = next((ms for ms, cfg in rows if cfg.endswith("(default)")), float("nan"))
            best = min(rows, default=(float("nan"), "-"))
            log(f"{kernel:<34} {default:8.4f} -> {best[0]:8.4f}  {best[1]}")
    failed = [n for n, ok in RESULTS if not ok]
    log("")
    verdict = "PASS" if not failed else "FAIL"
    log(f"{verdict}: {len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed in {time.time() - t0:.0f}s"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(0 if not failed else 1)


if __name__ == "__main__":
    main()
