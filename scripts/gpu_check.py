"""Correctness on the GPU: our engine against transformers on tiny random checkpoints.

    python scripts/gpu_check.py [--compiled] [--names all,dense,moe]

Against transformers, float32 greedy tokens must be identical (bfloat16 agreement is printed, not judged:
K=V layers round differently, see benchmarks/NOTES.md). Compiled runs must equal our eager run token for
token in each dtype. Prints one row per model and a final PASS/FAIL line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import make_checkpoint  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402


def hf_greedy_cuda(model, prompts, n):
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        outs.append(model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist())
    return outs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", default="all,dense,moe,k_eq_v,short_window")
    ap.add_argument("--compiled", action="store_true", help="also run without enforce_eager")
    ap.add_argument("--prompt-lengths", default="5,17,30", help="the prompts' token counts")
    ap.add_argument("--batched-tokens", type=int, default=16, help="the engine's per-step token budget (prompts "
                    "past it are prefilled in chunks; a larger one runs prefill-sized kernels, e.g. the router's)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    ok = True
    g = torch.Generator().manual_seed(0)
    for name in args.names.split(","):
        folder = root / name
        hf = make_checkpoint(folder, name)
        lengths = [int(n) for n in args.prompt_lengths.split(",")]
        prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
        modes = [True] + ([False] if args.compiled else [])
        for dtype in ("float32", "bfloat16"):
            ref_model = hf.to("cuda", getattr(torch, dtype))
            ref = hf_greedy_cuda(ref_model, prompts, 24)
            eager_out = None
            for eager in modes:
                t = time.perf_counter()
                llm = LLM(str(folder), device="cuda", dtype=dtype, enforce_eager=eager, block_size=16,
                          max_model_len=max(128, max(lengths) + 32), max_num_batched_tokens=args.batched_tokens)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                ours = [o.outputs[0].token_ids for o in outs]
                agree = min(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                            for x, y in zip(ours, ref))
                if eager:
                    eager_out = ours
                    good = agree == 24 or dtype == "bfloat16"
                else:
                    good = ours == eager_out if dtype == "float32" else True
                ok &= good
                print(f"{name:14s} {dtype:9s} {'eager' if eager else 'compiled':8s} agree={agree:2d}/24 "
                      f"{'ok' if good else 'MISMATCH'} ({time.perf_counter() - t:.1f}s)", flush=True)
                del llm
        hf.to("cpu", torch.float32)
    print("GPU CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
