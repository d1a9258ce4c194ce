"""Gated delta rule kernels (Gated DeltaNet) over a varlen batch with per-sequence state slots.

Same contract as the reference in compiled_llm/ops/delta_rule.py: q, k [tokens, Hk, Dk], v [tokens, Hv, Dv],
g (log decay) and beta [tokens, Hv]; q/k are L2-normalised in-kernel and q scaled by Dk^-0.5; value head h
reads key head h // (Hv // Hk); the state [slots, Hv, Dk, Dv] is float32 and updated in place.

- recurrent kernel (decode, short pieces): one program per (sequence, value head, block of BV value
  channels) keeps its [Dk, BV] slice of the state in registers and steps token by token.
- chunked prefill, C tokens a chunk. With cumulative log decay c inside the chunk and
  L[i, j] = beta_i exp(c_i - c_j) k_i.k_j (j < i), the corrections are d = u - w S with
  u = (I + L)^-1 beta V and w = (I + L)^-1 beta exp(c) K, the inverse being the product
  (I - L)(I + L^2)(I + L^4)... (L is nilpotent). A prep kernel computes u, w and the masked scores
  A = tril(exp(c_i - c_j) q_i.k_j) for all chunks in parallel; the state kernel then walks each sequence's
  chunks: o = exp(c) Q S + A d, S <- exp(c_C) S + (exp(c_C - c) K)^T d.
The batch layout (offsets, slots, initial-state flags, chunk plan) is the step's StateLayout (ops/state.py),
built and uploaded once per step: the kernels read device tensors only, and sequences without tokens (whole-graph
decode padding) leave their slot alone, so a CUDA graph replays the decode launch.
Matmuls run as 3xTF32 (float32-grade) for float32 models, so results track the reference, TF32 otherwise.

The op's gating (g and beta from the [b; a] columns of in_proj, GATING) is computed where g and beta are read:
the recurrent kernel and the chunk prep kernel. Its gated output norm (weight * o / rms(o) * silu(z) per value
head, NORM) needs a whole head's output in one program: the recurrent kernel applies it when its value block
spans the head (the decode policy's tile for 2 to 16 sequences); otherwise `_gated_norm_kernel` applies it in
place afterwards. Both round where the PyTorch reference (ops/delta_rule.py gated_rms_norm) rounds.

The op (`gated_delta_rule` below) starts from in_proj's [q; k; v] columns: the causal conv runs first, as the
causal_conv1d op's launches, except at a decode step of 1 to 16 sequences, where the recurrent kernel computes
it itself (CONV) and moves the windows: bitwise the two launches' result, one launch and a gap less a layer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from compiled_llm.ops.conv1d import CAUSAL_CONV1D
from compiled_llm.ops.delta_rule import split_qkv
from compiled_llm.ops.jit import JitKernel, register_kernel
from compiled_llm.ops.state import DELTA_RULE_CHUNK, WARM_LAYOUTS, StateLayout, get_state_metadata
from compiled_llm.ops.triton._common import dot_precision, ticket_counters
from compiled_llm.ops.triton.conv1d import _conv_silu_taps, _conv_store_moved, _conv_taps

RECURRENT_MAX_LEN = 4  # batches whose longest piece is this short take the recurrent kernel
CONV_TICKETS = 1 << 14  # the decode conv's (sequence, key head) counters, made once (64 KB): the fused launch takes
# at most 16 sequences (conv_in_recurrence), so this holds any model's key heads a rank
CONV_ENV = "COMPILED_LLM_GDR_CONV"  # 0: a decode step's conv in its own launch before the recurrence (an A/B)
CHUNK = DELTA_RULE_CHUNK


@triton.jit
def _gating(G, B, AL, DTB, t, sg_t, sb_t, hv, num_hv, mask, GATING: tl.constexpr):
    """(g, beta) in float32 of rows t (a scalar or a vector) of value head hv. GATING: G is the [b; a] columns
    (row stride sg_t): beta = sigmoid(b) rounded to their dtype, g = -exp(A_log) * softplus(a + dt_bias) (as
    torch's softplus: the identity past 20). Otherwise G and B hold g and beta."""
    if GATING:
        b = tl.load(G + t * sg_t + hv, mask=mask, other=0.0)
        a = tl.load(G + t * sg_t + num_hv + hv, mask=mask, other=0.0).to(tl.float32)
        beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
        x = a + tl.load(DTB + hv).to(tl.float32)
        soft = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(tl.load(AL + hv).to(tl.float32)) * soft
        g = tl.where(mask, g, 0.0)
        beta = tl.where(mask, beta, 0.0)
    else:
        g = tl.load(G + t * sg_t + hv, mask=mask, other=0.0).to(tl.float32)
        beta = tl.load(B + t * sb_t + hv, mask=mask, other=0.0).to(tl.float32)
    return g, beta


@triton.jit
def _gated_norm(o, z, w, mask, norm_eps, DV: tl.constexpr, OUT: tl.constexpr, ROUND_WH: tl.constexpr):
    """gated_rms_norm of one head's output o [.., BV] (float32, masked lanes ignored) with gate z and weight w
    (float32 copies): o rounded to the output dtype, normalised and rounded, times w (rounded when the weight
    has the output's dtype), times silu(z); returned in float32."""
    o = tl.where(mask, o.to(OUT).to(tl.float32), 0.0)
    rstd = tl.rsqrt(tl.sum(o * o, -1, keep_dims=True) / DV + norm_eps)
    h = (o * rstd).to(OUT).to(tl.float32)
    wh = w * h
    if ROUND_WH:
        wh = wh.to(OUT).to(tl.float32)
    return wh * (z * tl.sigmoid(z))


@triton.jit(do_not_specialize=["n_rows"])
def _gated_norm_kernel(X, Z, W, sx_t, sx_h, sz_t, sz_h, n_rows, norm_eps, DV: tl.constexpr, BD: tl.constexpr,
                       ROWS: tl.constexpr, ROUND_WH: tl.constexpr):
    """In place: X[t, h] <- gated_rms_norm(X[t, h], Z[t, h]) for ROWS token rows of head h a program."""
    h = tl.program_id(1)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    od = tl.arange(0, BD)
    m = (t < n_rows)[:, None] & (od < DV)[None, :]
    x = tl.load(X + t[:, None] * sx_t + h * sx_h + od[None, :], mask=m, other=0.0).to(tl.float32)
    z = tl.load(Z + t[:, None] * sz_t + h * sz_h + od[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + od, mask=od < DV, other=0.0).to(tl.float32)[None, :]
    y = _gated_norm(x, z, w, m, norm_eps, DV, X.dtype.element_ty, ROUND_WH)
    tl.store(X + t[:, None] * sx_t + h * sx_h + od[None, :], y.to(X.dtype.element_ty), mask=m)


@triton.jit
def _gdr_step(s, q, k, v, g, beta, scale, eps):
    """One token of the recurrence on a [Dk, BV] float32 state tile: q and k L2-normalised (q scaled), the state
    decayed, corrected and read out. Returns (state, o [BV])."""
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + eps) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit(do_not_specialize=["n_seqs", "n_rows"])
def _gdr_recurrent_kernel(Q, K, V, G, B, O, S, QSL, SLOTS, INIT, AL, DTB, Z, NW,
                          sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h, ss_n, ss_h, ss_k, sz_t, sz_h,
                          scale, eps, norm_eps, n_seqs, n_rows,
                          REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          GATING: tl.constexpr = False, NORM: tl.constexpr = False, ROUND_WH: tl.constexpr = False,
                          X=None, CW=None, CS=None, TK=None, sx_t=0, scs_n=0, scs_c=0,
                          CONV: tl.constexpr = False, KW: tl.constexpr = 4):
    # CONV (a decode step: one token a sequence): q, k and v come from the raw [q; k; v] columns X of in_proj
    # through the causal conv (weight CW [channels, KW], windows CS [slots, channels, KW - 1]) here, instead of
    # from the conv launch's output. Each program moves the windows of its own value channels; the q / k windows
    # of a key head are read by the REP x value-block programs that share it, so they take tickets from the
    # head's counter (TK) after reading, and the last one moves those windows and resets the counter (zero for
    # the next launch or CUDA-graph replay)
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    num_hv = tl.num_programs(1)
    start = tl.load(QSL + seq).to(tl.int64)
    end = tl.load(QSL + seq + 1).to(tl.int64)
    slot = tl.load(SLOTS + seq).to(tl.int64)
    init = tl.load(INIT + seq)
    pad_from = tl.load(QSL + n_seqs).to(tl.int64)  # read with the others; the padding rows are zeroed last
    hk = hv // REP
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    s_ptr = S + slot * ss_n + hv * ss_h + ok[:, None] * ss_k + ov[None, :]
    s = tl.load(s_ptr, mask=m2, other=0.0).to(tl.float32)  # first piece (init 0): the slot may hold anything
    if NORM:  # this program holds the whole head (BV >= DV)
        w = tl.load(NW + ov, mask=mv, other=0.0).to(tl.float32)
    if CONV:  # one step, straight through: every read is issued here, behind the state's, before any is waited on
        live = end > start  # nothing is read for a sequence without tokens, nor written
        keep = init != 0
        num_hk = num_hv // REP
        qc = hk * DK + ok  # the channels of q, k and v in X and in the windows
        kc = (num_hk + hk) * DK + ok
        vc = 2 * num_hk * DK + hv * DV + ov
        q0, q1, q2, qx = _conv_taps(X, CS, start, sx_t, slot, scs_n, scs_c, qc, mk & live, keep, KW)
        k0, k1, k2, kx = _conv_taps(X, CS, start, sx_t, slot, scs_n, scs_c, kc, mk & live, keep, KW)
        v0, v1, v2, vx = _conv_taps(X, CS, start, sx_t, slot, scs_n, scs_c, vc, mv & live, keep, KW)
        g, beta = _gating(G, B, AL, DTB, start, sg_t, sb_t, hv, num_hv, live, GATING)
        if NORM:
            z = tl.load(Z + start * sz_t + hv * sz_h + ov, mask=mv & live, other=0.0).to(tl.float32)
        q = _conv_silu_taps(q0, q1, q2, qx, CW, qc, mk, KW)
        k = _conv_silu_taps(k0, k1, k2, kx, CW, kc, mk, KW)
        v = _conv_silu_taps(v0, v1, v2, vx, CW, vc, mv, KW)
        if live:
            # the windows move before the state math, from the values read above (no second read; the ticket's
            # release then has only those reads and the state's load before it, no store)
            tl.debug_barrier()  # every thread's window reads precede the (one-thread) ticket below
            counter = TK + seq * num_hk + hk
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == REP * tl.num_programs(2) - 1:  # every reader of this key head's windows is done
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _conv_store_moved(CS, slot, scs_n, scs_c, qc, mk, q1, q2, qx, KW)
                _conv_store_moved(CS, slot, scs_n, scs_c, kc, mk, k1, k2, kx, KW)
            _conv_store_moved(CS, slot, scs_n, scs_c, vc, mv, v1, v2, vx, KW)  # this program's alone
        s = tl.where(keep, s, 0.0)  # here, not at the load: nothing above waits for the state
        s, o = _gdr_step(s, q, k, v, g, beta, scale, eps)
        if NORM:
            o = _gated_norm(o, z, w, mv, norm_eps, DV, O.dtype.element_ty, ROUND_WH)
        tl.store(O + start * so_t + hv * so_h + ov, o.to(O.dtype.element_ty), mask=mv & live)
    else:
        s = tl.where(init != 0, s, 0.0)
        for t64 in range(start, end):
            q = tl.load(Q + t64 * sq_t + hk * sq_h + ok, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(K + t64 * sk_t + hk * sk_h + ok, mask=mk, other=0.0).to(tl.float32)
            v = tl.load(V + t64 * sv_t + hv * sv_h + ov, mask=mv, other=0.0).to(tl.float32)
            g, beta = _gating(G, B, AL, DTB, t64, sg_t, sb_t, hv, num_hv, t64 < end, GATING)
            s, o = _gdr_step(s, q, k, v, g, beta, scale, eps)
            if NORM:
                z = tl.load(Z + t64 * sz_t + hv * sz_h + ov, mask=mv, other=0.0).to(tl.float32)
                o = _gated_norm(o, z, w, mv, norm_eps, DV, O.dtype.element_ty, ROUND_WH)
            tl.store(O + t64 * so_t + hv * so_h + ov, o.to(O.dtype.element_ty), mask=mv)
    tl.store(s_ptr, s.to(S.dtype.element_ty), mask=m2 & (end > start))  # no tokens: the slot is not ours
    if seq == 0:  # the rows past the last sequence (a CUDA graph's padding) are zero: no fill launch for them
        for t64 in range(pad_from, n_rows):
            tl.store(O + t64 * so_t + hv * so_h + ov, tl.zeros([BV], O.dtype.element_ty), mask=mv)


@triton.jit
def _gdr_chunk_prep_kernel(Q, K, V, G, B, U, W, A, CUM, CH_START, CH_END, AL, DTB,
                           sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, su_t, su_h, sw_t, sw_h, sc_t,
                           scale, eps,
                           REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                           BDV: tl.constexpr, C: tl.constexpr, LOG2C: tl.constexpr, PREC: tl.constexpr,
                           GATING: tl.constexpr = False):
    """Per (chunk, value head), independent of the state: u = T beta V, w = T beta exp(c) K with
    T = (I + L)^-1, the masked intra-chunk scores A = tril(exp(c_i - c_j) q_i.k_j) and c."""
    cid = tl.program_id(0)
    hv = tl.program_id(1)
    start = tl.load(CH_START + cid).to(tl.int64)
    end = tl.load(CH_END + cid).to(tl.int64)
    hk = hv // REP
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BDV)
    oc = tl.arange(0, C)
    mk = ok < DK
    mv = ov < DV
    t = start + oc
    mt = t < end
    mqk = mt[:, None] & mk[None, :]
    mtv = mt[:, None] & mv[None, :]
    # rows past the chunk's end load zeros (k = v = beta = g = 0): they change nothing
    q = tl.load(Q + t[:, None] * sq_t + hk * sq_h + ok[None, :], mask=mqk, other=0.0).to(tl.float32)
    k = tl.load(K + t[:, None] * sk_t + hk * sk_h + ok[None, :], mask=mqk, other=0.0).to(tl.float32)
    v = tl.load(V + t[:, None] * sv_t + hv * sv_h + ov[None, :], mask=mtv, other=0.0).to(tl.float32)
    g, beta = _gating(G, B, AL, DTB, t, sg_t, sb_t, hv, tl.num_programs(1), mt, GATING)
    q = q * (tl.rsqrt(tl.sum(q * q, 1) + eps) * scale)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
    c = tl.cumsum(g, 0)
    lower = oc[:, None] >= oc[None, :]
    decay = tl.exp(tl.where(lower, c[:, None] - c[None, :], float("-inf")))
    kt = tl.trans(k)
    eye = tl.where(oc[:, None] == oc[None, :], 1.0, 0.0)
    lmat = tl.where(oc[:, None] > oc[None, :], tl.dot(k, kt, input_precision=PREC) * decay * beta[:, None], 0.0)
    inv = eye - lmat  # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...
    power = tl.dot(lmat, lmat, input_precision=PREC)
    for _ in tl.static_range(LOG2C - 1):
        inv = tl.dot(inv, eye + power, input_precision=PREC)
        power = tl.dot(power, power, input_precision=PREC)
    u = tl.dot(inv, v * beta[:, None], input_precision=PREC)
    w = tl.dot(inv, k * (beta * tl.exp(c))[:, None], input_precision=PREC)
    scores = tl.where(lower, tl.dot(q, kt, input_precision=PREC) * decay, 0.0)
    tl.store(U + t[:, None] * su_t + hv * su_h + ov[None, :], u, mask=mtv)
    tl.store(W + t[:, None] * sw_t + hv * sw_h + ok[None, :], w, mask=mqk)
    tl.store(CUM + t * sc_t + hv, c, mask=mt)
    a_ptr = A + (cid * tl.num_programs(1) + hv).to(tl.int64) * C * C
    tl.store(a_ptr + oc[:, None] * C + oc[None, :], scores)


@triton.jit
def _gdr_chunk_state_kernel(Q, K, U, W, A, CUM, O, S, QSL, SLOTS, INIT, CH_FIRST,
                            sq_t, sq_h, sk_t, sk_h, su_t, su_h, sw_t, sw_h, sc_t, so_t, so_h, ss_n, ss_h, ss_k,
                            scale, eps,
                            REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
    """Per (sequence, value head, value block), chunk after chunk: d = u - w S, o = exp(c) q S + A d,
    S <- exp(c_C) S + (exp(c_C - c) k)^T d."""
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    num_hv = tl.num_programs(1)
    start = tl.load(QSL + seq).to(tl.int64)
    end = tl.load(QSL + seq + 1).to(tl.int64)
    first = tl.load(CH_FIRST + seq)
    last = tl.load(CH_FIRST + seq + 1)
    slot = tl.load(SLOTS + seq).to(tl.int64)
    init = tl.load(INIT + seq)
    hk = hv // REP
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    oc = tl.arange(0, C)
    mk = ok < DK
    mv = ov < DV
    m2 = mk[:, None] & mv[None, :]
    s_ptr = S + slot * ss_n + hv * ss_h + ok[:, None] * ss_k + ov[None, :]
    s = tl.load(s_ptr, mask=m2, other=0.0).to(tl.float32)
    s = tl.where(init != 0, s, 0.0)  # first piece: start from zeros (the slot may hold anything)
    for cid in range(first, last):
        cstart = start + (cid - first) * C
        t = cstart + oc
        mt = t < end
        mqk = mt[:, None] & mk[None, :]
        mtv = mt[:, None] & mv[None, :]
        q = tl.load(Q + t[:, None] * sq_t + hk * sq_h + ok[None, :], mask=mqk, other=0.0).to(tl.float32)
        k = tl.load(K + t[:, None] * sk_t + hk * sk_h + ok[None, :], mask=mqk, other=0.0).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + eps) * scale)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
        c = tl.load(CUM + t * sc_t + hv, mask=mt, other=0.0)
        c_last = tl.sum(tl.where(t == tl.minimum(end, cstart + C) - 1, c, 0.0), 0)
        u = tl.load(U + t[:, None] * su_t + hv * su_h + ov[None, :], mask=mtv, other=0.0)
        w = tl.load(W + t[:, None] * sw_t + hv * sw_h + ok[None, :], mask=mqk, other=0.0)
        a = tl.load(A + (cid * num_hv + hv).to(tl.int64) * C * C + oc[:, None] * C + oc[None, :])
        d = u - tl.dot(w, s, input_precision=PREC)
        o = tl.dot(q * tl.exp(c)[:, None], s, input_precision=PREC) + tl.dot(a, d, input_precision=PREC)
        tl.store(O + t[:, None] * so_t + hv * so_h + ov[None, :], o.to(O.dtype.element_ty), mask=mtv)
        kd = tl.where(mt[:, None], k * tl.exp(c_last - c)[:, None], 0.0)
        s = s * tl.exp(c_last) + tl.dot(tl.trans(kd), d, input_precision=PREC)
    tl.store(s_ptr, s.to(S.dtype.element_ty), mask=m2 & (end > start))  # no tokens: the slot is not ours


def _lastdim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def recurrent_tiles_policy(num_seqs: int, dv: int, norm: bool) -> tuple[int, int]:
    """(value block, num_warps) of the recurrent kernel. H200 (benchmarks/state_kernels.py, sessions 20-21):
    32-channel blocks, 4 warps are best at 1 to 32 sequences (Qwen3.5: 3.67 / 13.43 / 45.96 us), a whole
    128-channel head costs the same at 8 (13.52) but more at 1 (5.49) and 32 (47.68). With the gated norm to
    apply, the whole head takes it in this launch (no norm launch after: ~2 us a layer at decode), so it
    wins from 2 to 16 sequences."""
    if norm and 2 <= num_seqs <= 16 and dv <= 128:
        return max(16, triton.next_power_of_2(dv)), 4
    return max(16, min(32, triton.next_power_of_2(dv))), 4


def gated_delta_rule_varlen(q, k, v, g, beta, cache: torch.Tensor, layout: StateLayout,
                            recurrent_tiles: tuple[int, int] | None = None, *, gating: tuple | None = None,
                            out_norm: tuple | None = None, conv: tuple | None = None) -> torch.Tensor:
    """Flat tokens of the layout's sequences (rows past them: padding, left zero); its tensors on v's device.
    The chunked path takes layout.chunk tokens a chunk. recurrent_tiles: (value block, num_warps) of the
    recurrent kernel, overriding the policy (benchmarks/state_kernels.py sweeps them).
    gating: (ba [tokens, 2 Hv] as [b; a], A_log [Hv], dt_bias [Hv]) instead of g and beta (then None);
    out_norm: (z [tokens, Hv, Dv], weight [Dv], eps): the output is gated_rms_norm(o, z).
    conv (a decode layout only; out_norm required): (x [tokens, [q; k; v] channels] before the causal conv, any
    row stride; its weight [channels, K]; its windows [slots, channels, K - 1], updated in place; Hk): q, k and v
    are None and the conv runs inside the recurrent launch (`_gdr_recurrent_kernel` CONV)."""
    if conv is not None:
        x, conv_w, conv_cache, hk = conv
        assert layout.decode and out_norm is not None, "the conv runs in the recurrent launch at decode only"
        x, conv_w = _lastdim_contiguous(x), conv_w.contiguous()
        assert conv_cache.shape[1:] == (x.shape[1], conv_w.shape[1] - 1) and conv_cache.stride(2) == 1
        # views of X (the kernel reads X and the windows instead); split_qkv checks the channel count
        q, k, v = split_qkv(x, hk, out_norm[0].shape[1], out_norm[0].shape[2])
    q, k, v = _lastdim_contiguous(q), _lastdim_contiguous(k), _lastdim_contiguous(v)
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert cache.stride(-1) == 1 and cache.shape[1:] == (hv, dk, dv), (cache.shape, (hv, dk, dv))
    dev = v.device
    if gating is not None:  # the [b; a] columns stand in for both (any row stride: a view of in_proj's output)
        g, a_log, dt_bias = _lastdim_contiguous(gating[0]), gating[1].contiguous(), gating[2].contiguous()
        beta = g
        assert g.shape[-1] == 2 * hv and a_log.numel() == hv == dt_bias.numel(), (g.shape, a_log.shape, hv)
    else:
        g, beta = _lastdim_contiguous(g), _lastdim_contiguous(beta)  # any row stride (views of one tensor)
        a_log = dt_bias = g  # unused
    if out_norm is not None:
        z, norm_w, norm_eps = _lastdim_contiguous(out_norm[0]), out_norm[1].contiguous(), float(out_norm[2])
        round_wh = torch.promote_types(norm_w.dtype, v.dtype) == v.dtype
    else:
        z, norm_w, norm_eps, round_wh = v, v, 0.0, False  # unused
    num_seqs = layout.num_seqs
    if n == 0 or num_seqs == 0:
        return torch.zeros(v.shape, dtype=v.dtype, device=dev)
    recurrent = layout.max_query_len <= RECURRENT_MAX_LEN  # that kernel writes every row, padding as zeros
    o = (torch.empty if recurrent else torch.zeros)(v.shape, dtype=v.dtype, device=dev)
    t = layout.tensors
    query_start_loc, slots, has_initial_state = t["query_start_loc"], t["slots"], t["has_initial_state"]
    bk = max(16, triton.next_power_of_2(dk))
    if recurrent:
        bv, rec_warps = recurrent_tiles or recurrent_tiles_policy(num_seqs, dv, out_norm is not None)
    else:  # the chunk state kernel's value block (its [C, BV] and [Dk, BV] float32 tiles)
        bv = max(16, min(32, triton.next_power_of_2(dv)))
    norm_in_kernel = recurrent and out_norm is not None and bv >= dv
    prec = dot_precision(v.dtype)
    grid = (num_seqs, hv, triton.cdiv(dv, bv))
    scale, eps = dk ** -0.5, 1e-6
    if recurrent:
        fused = {}
        if conv is not None:  # the q / k windows' tickets: one counter a (sequence, key head), made once and large
            # enough (a counter buffer that grew would leave a captured graph its freed first one)
            counters = ticket_counters(("gdr_conv", dev), max(num_seqs * hk, CONV_TICKETS), dev)
            fused = dict(X=x, CW=conv_w, CS=conv_cache, TK=counters, sx_t=x.stride(0), scs_n=conv_cache.stride(0),
                         scs_c=conv_cache.stride(1), CONV=True, KW=conv_w.shape[1])
        _gdr_recurrent_kernel[grid](
            q, k, v, g, beta, o, cache, query_start_loc, slots, has_initial_state, a_log, dt_bias, z, norm_w,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            o.stride(0), o.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), z.stride(0), z.stride(1),
            scale, eps, norm_eps, num_seqs, n,
            REP=hv // hk, DK=dk, DV=dv, BK=bk, BV=bv, GATING=gating is not None, NORM=norm_in_kernel,
            ROUND_WH=round_wh, num_warps=rec_warps, **fused)
    else:
        chunk, num_chunks = layout.chunk, layout.num_chunks
        u = torch.empty((n, hv, dv), dtype=torch.float32, device=dev)
        w = torch.empty((n, hv, dk), dtype=torch.float32, device=dev)
        cum = torch.empty((n, hv), dtype=torch.float32, device=dev)
        scores = torch.empty((num_chunks, hv, chunk, chunk), dtype=torch.float32, device=dev)
        _gdr_chunk_prep_kernel[(num_chunks, hv)](
            q, k, v, g, beta, u, w, scores, cum, t["chunk_starts"], t["chunk_ends"], a_log, dt_bias,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), u.stride(0), u.stride(1), w.stride(0), w.stride(1), cum.stride(0), scale, eps,
            REP=hv // hk, DK=dk, DV=dv, BK=bk, BDV=max(16, triton.next_power_of_2(dv)), C=chunk,
            LOG2C=chunk.bit_length() - 1, PREC=prec, GATING=gating is not None, num_warps=4)
        _gdr_chunk_state_kernel[grid](
            q, k, u, w, scores, cum, o, cache, query_start_loc, slots, has_initial_state, t["chunk_first"],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), u.stride(0), u.stride(1), w.stride(0), w.stride(1),
            cum.stride(0), o.stride(0), o.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), scale, eps,
            REP=hv // hk, DK=dk, DV=dv, BK=bk, BV=bv, C=chunk, PREC=prec, num_warps=4,
            num_stages=2 if chunk <= 32 else 1)  # the pipelined [C, Dk] float32 tiles must fit in shared memory
    if out_norm is not None and not norm_in_kernel:
        rows = 4
        _gated_norm_kernel[(triton.cdiv(n, rows), hv)](
            o, z, norm_w, o.stride(0), o.stride(1), z.stride(0), z.stride(1), n, norm_eps, DV=dv,
            BD=max(16, triton.next_power_of_2(dv)), ROWS=rows, ROUND_WH=round_wh, num_warps=4)
    return o


def conv_in_recurrence(num_seqs: int, dv: int, kw: int) -> bool:
    """A decode step's conv (of 2 to 4 taps: _conv_taps) inside the recurrent launch from 1 to 16 sequences.
    From 2 to 16 the policy's tile holds whole value heads, so REP programs share a key head's q / k conv; at one
    sequence its four value blocks each compute it again, which still costs less than the conv's own launch.
    H200, Qwen3.5 35B-A3B (benchmarks/state_kernels.py conv_gdr, session 30, every read issued before any is
    waited on, the windows moved from the values read): the two launches -> one, 7.44 -> 5.96 us at one
    sequence, 18.28 -> 15.31 at 8, 31.94 -> 28.63 at 16, but 54.63 -> 57.11 at 32 (four blocks a head, 32
    sequences: the conv again 4x)."""
    return 1 <= num_seqs <= 16 and dv <= 128 and 2 <= kw <= 4


def gated_delta_rule(qkv, conv_weight, ba, a_log, dt_bias, z, norm_weight, eps: float, num_k_heads: int,
                     layer_idx: int) -> torch.Tensor:
    """The op's Triton provider: state and batch layout from the forward context. A decode step of 1 to 16
    sequences runs the causal conv inside the recurrent launch (conv_in_recurrence; unless the conv op's provider
    was overridden, or COMPILED_LLM_GDR_CONV=0); other steps run the conv op's launches, then the delta rule's."""
    meta = get_state_metadata()
    caches, layout = meta.caches[layer_idx], meta.layout
    gating, out_norm = (ba, a_log, dt_bias), (z, norm_weight, eps)
    if (layout.decode and conv_in_recurrence(layout.num_seqs, z.shape[2], conv_weight.shape[1])
            and CAUSAL_CONV1D.provider_name() == "triton" and os.environ.get(CONV_ENV, "1") != "0"):
        return gated_delta_rule_varlen(None, None, None, None, None, caches["ssm"], layout, gating=gating,
                                       out_norm=out_norm, conv=(qkv, conv_weight, caches["conv"], num_k_heads))
    mixed = CAUSAL_CONV1D.impl()(qkv, conv_weight, layer_idx)
    q, k, v = split_qkv(mixed, num_k_heads, z.shape[1], z.shape[2])
    return gated_delta_rule_varlen(q, k, v, None, None, caches["ssm"], layout, gating=gating, out_norm=out_norm)


# ---- JIT warm-up ---------------------------------------------------------------------------------

def _keys(facts: dict) -> list:
    """(dtype, key heads, value heads, key dim, value dim, conv window) of each distinct linear-attention layer,
    from its state (`facts["states"]`: conv window [q; k; v channels, K - 1] and the delta-rule matrix [value heads,
    key dim, value dim]; the key heads follow from the channels: 2 * hk * dk + hv * dv)."""
    keys = set()
    for spec in (facts.get("states") or {}).values():
        if "ssm" not in spec.shapes or "conv" not in spec.shapes:
            continue
        (hv, dk, dv), (channels, window) = spec.shapes["ssm"], spec.shapes["conv"]
        hk, rest = divmod(channels - hv * dv, 2 * dk)
        if hk > 0 and not rest and hv % hk == 0:
            keys.add((facts["dtype"], hk, hv, dk, dv, window + 1))
    return sorted(keys, key=repr)


def model_views(n: int, hk: int, hv: int, dk: int, dv: int, dtype, device) -> tuple:
    """Zero inputs laid out as Qwen3.5's layer passes them (qwen3_5.py GatedDeltaNet): q, k, v as head views of
    the conv's [tokens, q; k; v] output, z and [b; a] as views of in_proj's [tokens, q; k; v; z; b; a] rows,
    so that the warm-up's launches take the model's strides and alignments (Triton specialises on both)."""
    conv_dim = 2 * hk * dk + hv * dv
    mixed = torch.zeros(n, conv_dim, dtype=dtype, device=device)
    y = torch.zeros(n, conv_dim + hv * dv + 2 * hv, dtype=dtype, device=device)
    q = mixed[:, :hk * dk].view(n, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].view(n, hk, dk)
    v = mixed[:, 2 * hk * dk:].view(n, hv, dv)
    z = y[:, conv_dim:conv_dim + hv * dv].view(n, hv, dv)
    return q, k, v, z, y[:, conv_dim + hv * dv:]


def _compile(key, device) -> None:
    dtype, hk, hv, dk, dv, kw = key
    cache = torch.zeros(2, hv, dk, dv, dtype=torch.float32, device=device)
    a_log, dt_bias = (torch.zeros(hv, dtype=dtype, device=device) for _ in range(2))
    norm_w = torch.ones(dv, dtype=dtype, device=device)
    conv_dim = 2 * hk * dk + hv * dv
    conv_w = torch.zeros(conv_dim, kw, dtype=dtype, device=device)
    conv_cache = torch.zeros(2, conv_dim, kw - 1, dtype=dtype, device=device)
    for slots, init, qsl in WARM_LAYOUTS:
        n, layout = qsl[-1], StateLayout.build(slots, init, qsl, device)
        q, k, v, z, ba = model_views(n, hk, hv, dk, dv, dtype, device)
        gated_delta_rule_varlen(q, k, v, None, None, cache, layout, gating=(ba, a_log, dt_bias),
                                out_norm=(z, norm_w, 1e-6))
        if layout.decode and conv_in_recurrence(layout.num_seqs, dv, kw):  # the conv inside the recurrent launch,
            # reading in_proj's [q; k; v] columns in place
            qkv = ba.as_strided((n, conv_dim), (ba.stride(0), 1), 0)  # in_proj's first columns (a slice's row
            # stride: z's, a view, has another at one row)
            gated_delta_rule_varlen(None, None, None, None, None, cache, layout, gating=(ba, a_log, dt_bias),
                                    out_norm=(z, norm_w, 1e-6), conv=(qkv, conv_w, conv_cache, hk))


register_kernel(JitKernel("gated_delta_rule", "gated_delta_rule", "triton", _keys, _compile))
