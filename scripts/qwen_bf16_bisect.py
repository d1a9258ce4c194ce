"""Which part of the compiled Qwen3.5 path moves bfloat16 logprobs away from float32 eager (gpu_smoke's bf16 test).

Runs the tiny model once in float32 eager (the reference), once in bfloat16 eager, then the compiled engine in
bfloat16 under each variant (op-provider overrides, fusion passes, CUDA graphs), printing each one's teacher-forced
logprob error against float32 eager. `--device cpu` with TRITON_INTERPRET=1 runs the Triton kernels on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]

from compiled_llm import LLM  # noqa: E402
from gpu_smoke import greedy, logprob_error, make_tiny, probes, release  # noqa: E402

VARIANTS = {  # name: LLM keyword overrides for the compiled run ("dtype", "inductor": Inductor config to set)
    "compiled": {},
    "compiled_f32": {"dtype": "float32"},  # compiled float32 against float32 eager: a real difference shows here
    "passes_none": {"compile_passes": "none"},
    "pass_norm": {"compile_passes": "add_rms_norm"},
    "pass_qk": {"compile_passes": "qk_norm_rope_kv_write"},
    "emulate_casts": {"inductor": {"emulate_precision_casts": True}},
    "emulate_casts_none": {"compile_passes": "none", "inductor": {"emulate_precision_casts": True}},
    "norm_triton": {"op_providers": "fused_add_rms_norm=triton"},
    "norm_inductor": {"op_providers": "fused_add_rms_norm=inductor"},
    "norm_ref": {"op_providers": "fused_add_rms_norm=reference,rms_norm=reference"},
    "no_graphs": {"cudagraph_batch_sizes": "none"},
    "qk_ref": {"op_providers": "qk_norm_mrope_kv_write=reference", "cudagraph_batch_sizes": "none"},
    "gdr_ref": {"op_providers": "gated_delta_rule=reference", "cudagraph_batch_sizes": "none"},
    "conv_ref": {"op_providers": "causal_conv1d=reference", "cudagraph_batch_sizes": "none"},
    "eager_ref_ops": {"enforce_eager": True, "op_providers": "gated_delta_rule=reference,causal_conv1d=reference"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", default="qwen_dense")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    rows = []
    for name in args.names.split(","):
        g = torch.Generator().manual_seed(0)
        folder = make_tiny(root, name)
        vocab = json.loads((folder / "config.json").read_text())
        vocab = (vocab.get("text_config") or vocab)["vocab_size"]
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 30)]
        kw = dict(device=args.device, block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
        eager = LLM(str(folder), enforce_eager=True, dtype="float32", **kw)
        ref32 = [t for t, _ in greedy(eager, prompts)]
        probe32 = probes(eager, prompts, ref32)
        del eager
        eager = LLM(str(folder), enforce_eager=True, dtype="bfloat16", **kw)
        err_eager = logprob_error(probes(eager, prompts, ref32), probe32)
        del eager
        print(f"{name} bf16 eager: {err_eager:.4f}", flush=True)
        for v in args.variants.split(","):
            over = dict(VARIANTS[v])
            inductor = over.pop("inductor", {})
            t = time.perf_counter()
            llm = None
            try:
                opts = dict(enforce_eager=False, dtype="bfloat16",
                            cudagraph_batch_sizes="1,2,4" if args.device == "cuda" else None)
                opts.update(over)
                with torch._inductor.config.patch(inductor):
                    llm = LLM(str(folder), **opts, **kw)
                    err = logprob_error(probes(llm, prompts, ref32), probe32)
            except Exception as e:  # noqa: BLE001  (a variant that cannot run is reported)
                err = f"{type(e).__name__}: {e}"[:200]
            finally:
                del llm
                torch._dynamo.reset()  # a failed start's compiled pieces (and the model they hold) go too
            release(args.device)
            rows.append({"model": name, "variant": v, "err": err, "err_eager": err_eager})
            e = f"{err:.4f}" if isinstance(err, float) else err
            print(f"{name} {v:14s} {e}  ({time.perf_counter() - t:.1f}s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
