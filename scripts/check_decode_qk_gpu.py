"""The decode attention with its QK-norm + RoPE + KV write inside (ops/triton/qk_norm_rope.py DEFERRED_QK) against
the op's own launch followed by the plain decode, on the GPU at Gemma 4 26B-A4B's sliding-layer shapes (head_dim
256, 8 KV heads of 2 query heads, window 1,024), several batches, contexts and split counts: outputs within
bfloat16 rounding, the written cache rows bit for bit (the kernel writes the new key and reads it back in one
program: a missing barrier would show here). Prints one row a case and PASS / FAIL.

    python scripts/check_decode_qk_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_triton_kernels import _decode_qk_step  # noqa: E402


def main() -> int:
    ok = True
    for seqs, ctx, splits in ((1, 1100, 16), (8, 1100, 8), (4, 8500, 8), (8, 300, 4), (2, 40, 1)):
        lens = [ctx - 37 * i for i in range(seqs)] + [5]  # and a padding sequence (slot -1) last
        case = dict(seq_lens=lens, page=16, kv_heads=8, group=2, head_dim=256, window=1024, softcap=None,
                    splits=splits, norm_v=True, pad_seq=len(lens) - 1, device="cuda")
        (ref, ref_cache, slots), (got, cache, _) = (_decode_qk_step(d, torch.bfloat16, **case) for d in (False, True))
        live = list(range(seqs))
        err = (got[live].float() - ref[live].float()).abs().max().item()
        rows = all(torch.equal(cache.view(2, -1, 8, 256)[:, s], ref_cache.view(2, -1, 8, 256)[:, s])
                   for s in slots[:seqs])
        good = err <= 2e-2 and rows and torch.equal(cache.isnan(), ref_cache.isnan())
        ok &= good
        print(f"seqs {seqs} ctx {ctx} splits {splits}: max err {err:.2e}, cache rows equal {rows} "
              f"{'ok' if good else 'FAIL'}", flush=True)
    print("DECODE QK CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
