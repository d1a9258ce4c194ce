"""Qwen3.5 on the GPU: delta-rule kernels against the reference at real sizes, then our engine against
transformers on tiny random checkpoints (float32 greedy tokens must be identical), with the reference and the
Triton delta-rule provider.

    python scripts/qwen3_5_gpu_check.py [--names dense,moe,dense_vl,moe_vl] [--skip-kernels]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from qwen3_5_tiny import make_qwen_checkpoint  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402
from compiled_llm.ops.delta_rule import GATED_DELTA_RULE, gated_delta_rule_with_state  # noqa: E402
from compiled_llm.ops.state import StateLayout  # noqa: E402
from compiled_llm.ops.registry import Capabilities  # noqa: E402


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def check_kernels() -> bool:
    from compiled_llm.ops.triton.delta_rule import gated_delta_rule_varlen

    ok = True
    g = torch.Generator(device="cuda").manual_seed(0)
    hk, hv, dk, dv = 16, 32, 128, 128  # Qwen3.5-27B / 35B-A3B linear-attention heads
    for lens, dtype, chunk in [([1] * 64, torch.float32, 64), ([300, 1, 77, 1, 1000], torch.float32, 32),
                               ([300, 1, 77, 1, 1000], torch.float32, 64), ([4096], torch.float32, 64),
                               ([4096], torch.bfloat16, 32), ([4096], torch.bfloat16, 64),
                               ([512] * 8, torch.bfloat16, 64), ([1] * 64, torch.bfloat16, 64)]:
        n = sum(lens)
        q = torch.randn(n, hk, dk, device="cuda", generator=g, dtype=dtype)
        k = torch.randn(n, hk, dk, device="cuda", generator=g, dtype=dtype)
        v = torch.randn(n, hv, dv, device="cuda", generator=g, dtype=dtype)
        decay = -torch.rand(n, hv, device="cuda", generator=g) * 0.5
        beta = torch.rand(n, hv, device="cuda", generator=g).to(dtype)
        cache = torch.randn(len(lens) + 1, hv, dk, dv, device="cuda", generator=g) * 0.1
        slots = list(range(1, len(lens) + 1))
        init = [i % 2 == 0 for i in range(len(lens))]
        qsl = [0]
        for ln in lens:
            qsl.append(qsl[-1] + ln)
        ref_cache = cache.clone()
        layout = StateLayout.build(slots, init, qsl, "cuda", chunk=chunk)
        ref = gated_delta_rule_with_state(q, k, v, decay, beta, ref_cache, layout)
        got_cache = cache.clone()
        got = gated_delta_rule_varlen(q, k, v, decay, beta, got_cache, layout)
        err = (got.float() - ref.float()).abs().max().item()
        serr = (got_cache - ref_cache).abs().max().item()
        tol = 1e-3 if dtype == torch.float32 else 3e-2
        good = err < tol and serr < tol
        ok &= good
        t_ref = timed(lambda: gated_delta_rule_with_state(q, k, v, decay, beta, cache.clone(), layout), 2)
        t_tri = timed(lambda: gated_delta_rule_varlen(q, k, v, decay, beta, cache.clone(), layout))
        print(f"kernel lens={lens if len(lens) < 8 else f'{len(lens)}x{lens[0]}'} {str(dtype)[6:]} chunk={chunk}: "
              f"out err {err:.2e} state err {serr:.2e} {'ok' if good else 'FAIL'}; "
              f"reference {t_ref:.2f} ms, triton {t_tri:.2f} ms", flush=True)
    return ok


def hf_greedy_cuda(model, prompts, n):
    model.generation_config.eos_token_id = None
    return [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", default="dense,moe,dense_vl,moe_vl")
    ap.add_argument("--skip-kernels", action="store_true")
    args = ap.parse_args()
    ok = True if args.skip_kernels else check_kernels()
    if not args.names:
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    root = Path(tempfile.mkdtemp())
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    caps = Capabilities.detect("cuda")
    for name in args.names.split(","):
        hf = make_qwen_checkpoint(root / name, name)
        vocab = hf.config.get_text_config().vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 30, 90)]
        ref = hf_greedy_cuda(hf.to("cuda"), prompts, 24)
        for provider in ("reference", "triton"):
            GATED_DELTA_RULE.select(caps, {}, force=provider)
            for chunked in (False, True):
                llm = LLM(str(root / name), device="cuda", dtype="float32", enforce_eager=True, max_model_len=256,
                          max_num_batched_tokens=16 if chunked else 2048)
                t = time.perf_counter()
                outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                     params)]
                dt = time.perf_counter() - t
                match = [sum(a == b for a, b in zip(x, y)) for x, y in zip(outs, ref)]
                good = outs == ref
                ok &= good
                print(f"{name:9s} {provider:9s} chunked={chunked!s:5s} float32 greedy {match} of 24 "
                      f"{'ok' if good else 'FAIL'} ({dt:.1f} s)", flush=True)
                del llm
        GATED_DELTA_RULE.chosen.clear()
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
