"""The decode attention with its QK-norm + RoPE + KV write inside (ops/triton/qk_norm_rope.py DEFERRED_QK) against
the op's own launch followed by the plain decode, on the GPU at Gemma 4 26B-A4B's shapes, several batches, contexts
and split counts: outputs within bfloat16 rounding, the written cache rows bit for bit (the kernel writes the new
row and reads it back in one program: a missing barrier would show here). The sliding layers (head_dim 256, 8 KV
heads of 2 query heads, window 1,024), and the global ones (K=V, head_dim 512, 2 KV heads of 8, rows that keep
their 64 + 64 rotated key dims), whose op launch is also checked against the PyTorch reference. The kernel's two
QK forms (COMPILED_LLM_DECODE_QK=2, the default write-back form, and =1, in registers) give bitwise the same outputs
and rows. Prints one row a case and PASS / FAIL.

    python scripts/check_decode_qk_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_triton_kernels import _decode_qk_rot_step, _decode_qk_step  # noqa: E402

CASES = ((1, 1100, 16), (8, 1100, 8), (4, 8500, 8), (8, 300, 4), (2, 40, 1))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, the unwritten (NaN) rows included."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def sliding() -> bool:
    ok = True
    for seqs, ctx, splits in CASES:
        lens = [ctx - 37 * i for i in range(seqs)] + [5]  # and a padding sequence (slot -1) last
        case = dict(seq_lens=lens, page=16, kv_heads=8, group=2, head_dim=256, window=1024, softcap=None,
                    splits=splits, norm_v=True, pad_seq=len(lens) - 1, device="cuda")
        (ref, ref_cache, slots, _), (got, cache, _, _), (back, back_cache, _, _) = (
            _decode_qk_step(d, torch.bfloat16, **case) for d in (False, True, "back"))
        live = list(range(seqs))
        err = (got[live].float() - ref[live].float()).abs().max().item()
        rows = all(torch.equal(cache.view(2, -1, 8, 256)[:, s], ref_cache.view(2, -1, 8, 256)[:, s])
                   for s in slots[:seqs])
        same = torch.equal(back[live], got[live]) and _same(back_cache, cache)  # the write-back form
        good = err <= 2e-2 and rows and same and torch.equal(cache.isnan(), ref_cache.isnan())
        ok &= good
        print(f"sliding: seqs {seqs} ctx {ctx} splits {splits}: max err {err:.2e}, cache rows equal {rows}, "
              f"write-back form bitwise {same} {'ok' if good else 'FAIL'}", flush=True)
    return ok


def global_kv() -> bool:
    ok = True
    for seqs, ctx, splits in CASES:
        lens = [ctx - 37 * i for i in range(seqs)] + [5]
        case = dict(lens=lens, page=16, kv_heads=2, group=8, head_dim=512, softcap=None, splits=splits,
                    pad_seq=len(lens) - 1, device="cuda")
        (ref, ref_rows, slots), (own, own_rows, _), (got, rows, _), (back, back_rows, _) = (
            _decode_qk_rot_step(m, torch.bfloat16, **case) for m in ("reference", "launch", "deferred", "back"))
        live = list(range(seqs))
        flat, own_flat, ref_flat = (r.view(-1, 2, r.shape[-1]) for r in (rows, own_rows, ref_rows))
        err = (got[live].float() - own[live].float()).abs().max().item()
        ref_err = (own[live].float() - ref[live].float()).abs().max().item()
        row_err = max((own_flat[s].float() - ref_flat[s].float()).abs().max().item() for s in slots[:seqs])
        equal = all(torch.equal(flat[s], own_flat[s]) for s in slots[:seqs])
        same = torch.equal(back[live], got[live]) and _same(back_rows, rows)  # the write-back form
        good = (err <= 2e-2 and ref_err <= 5e-2 and row_err <= 6e-2 and equal and same
                and torch.equal(flat.isnan(), own_flat.isnan()))
        ok &= good
        print(f"global: seqs {seqs} ctx {ctx} splits {splits}: deferred vs launch max err {err:.2e}, rows equal "
              f"{equal}; launch vs reference {ref_err:.2e}, rows {row_err:.2e}; write-back form bitwise {same} "
              f"{'ok' if good else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    ok = sliding()
    ok &= global_kv()
    print("DECODE QK CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
