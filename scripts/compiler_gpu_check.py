"""The compiler on a GPU: Triton providers against the references, compiled (CUDA graphs, whole-graph
decode where faster) against eager on the tiny models, the compile cache round trip, and decode speed.

    python scripts/compiler_gpu_check.py [--sections kernels,models,cache,speed,structured] [--out DIR]

Prints one line per check and a final PASS/FAIL; writes results.json to --out when given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
RESULTS: dict = {}


def kernels() -> bool:
    ok = True
    env = dict(os.environ, OP_TEST_DEVICE="cuda", PYTHONPATH=str(ROOT))
    for group in ("norm", "qk_norm_rope", "kv_write", "attention", "moe"):
        r = subprocess.run([sys.executable, str(ROOT / "tests/test_op_providers.py"), group], env=env,
                           capture_output=True, text=True)
        good = r.returncode == 0
        ok &= good
        print(f"kernel {group:14s} {'ok' if good else 'FAIL ' + (r.stdout + r.stderr)[-1500:]}", flush=True)
    RESULTS["kernels"] = ok
    return ok


def models(names: list[str]) -> bool:
    from compiled_llm import LLM, SamplingParams
    from tiny_models import CONFIGS, make_checkpoint

    # head_dim 32: the Triton attention kernels (head_dim >= 32) and whole-graph decode engage
    for base in ("dense", "moe", "all"):
        CONFIGS[f"{base}32"] = dict(CONFIGS[base], head_dim=32, global_head_dim=32)
    ok = True
    root = Path(tempfile.mkdtemp())
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for name in names:
        hf = make_checkpoint(root / name, name)
        prompts = [{"prompt_token_ids": torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()}
                   for n in (5, 17, 30)]
        for dtype in ("float32", "bfloat16"):
            kw = dict(device="cuda", dtype=dtype, block_size=16, max_model_len=128, max_num_seqs=4,
                      max_num_batched_tokens=64)
            eager = LLM(str(root / name), enforce_eager=True, **kw)
            ref = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
            del eager
            t = time.perf_counter()
            llm = LLM(str(root / name), enforce_eager=False, cudagraph_batch_sizes="1,2,4", jit_monitor="error", **kw)
            start = time.perf_counter() - t
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            one = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts[:1]]
            comp = llm.engine.executor.runner.compiler
            s = comp.summary()
            agree = min(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(outs, ref))
            # bfloat16: printed, not judged (random tiny models hold near-ties: moe32 diverged at token 4 of 16 in
            # session 5 and dense32 / moe32 at 4 / 6 of 24 in session 41, compiled within bf16 eager's logprob error;
            # scripts/gpu_smoke.py judges bf16 by that error)
            good = (outs == ref and one == ref[:1]) if dtype == "float32" else True
            ok &= good
            RESULTS[f"{name}/{dtype}"] = {"agree": agree, "startup_s": start, **s}
            print(f"model {name:8s} {dtype:9s} compiled vs eager agree={agree}/24 {'ok' if good else 'MISMATCH'} "
                  f"start-up {start:.1f}s graphs={s['captured_graphs']} whole-graph={s['whole_graph_decode_sizes']} "
                  f"decode ms {s['decode_timings_ms']} matches={ {k: v['matches'] for k, v in s['passes'].items()} }",
                  flush=True)
            del llm
    RESULTS["models"] = ok
    return ok


def cache() -> bool:
    from tiny_models import make_checkpoint

    root = Path(tempfile.mkdtemp())
    make_checkpoint(root / "dense", "dense")
    out = root / "cc"
    runs = []
    for i in range(2):
        # Inductor rewrites its wrapper modules (.py) on load: their '# kernel path' comments name the folder
        before = sorted(p.name for p in out.rglob("*") if p.suffix != ".py") if out.exists() else []
        r = subprocess.run([sys.executable, "-m", "compiled_llm", "compile-cache", "--model", str(root / "dense"),
                            "--out", str(out), "--report", "--device", "cuda", "--dtype", "bfloat16",
                            "--max-model-len", "128", "--max-num-seqs", "4", "--cudagraph-batch-sizes", "1,2,4"],
                           cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        after = sorted(p.name for p in out.rglob("*") if p.suffix != ".py")
        m = re.search(r"compile cache \S+: (\w+).*start-up ([\d.]+)s", r.stdout)
        print("new files:", sorted(set(after) - set(before))[:12] if i else "", flush=True)
        runs.append({"rc": r.returncode, "status": m and m.group(1), "seconds": m and float(m.group(2)),
                     "new_files": len(set(after) - set(before)), "counters": r.stdout.split("compiles this run:")[-1]
                     .strip()})
        print(f"cache run {i}: {runs[-1]}", flush=True)
        if r.returncode:
            print(r.stdout[-2000:], r.stderr[-3000:])
    ok = (runs[0]["status"] == "built" and runs[1]["status"] == "hit" and runs[1]["new_files"] == 0
          and "fxgraph_cache_miss=0" in runs[1]["counters"])
    RESULTS["cache"] = runs
    print(f"cache round trip {'ok' if ok else 'FAIL'}; speed-up {runs[0]['seconds'] / max(runs[1]['seconds'], 1e-9):.1f}x")
    return ok


def speed() -> bool:
    """Decode step time of a mid-size Gemma 4 shaped model with dummy bf16 weights: eager vs compiled."""
    from compiled_llm import LLM, SamplingParams

    root = Path(tempfile.mkdtemp())
    cfg = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 32000,
           "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 6, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 1,
           "attention_k_eq_v": True, "sliding_window": 512, "max_position_embeddings": 4096,
           "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "final_logit_softcapping": 30.0,
           "enable_moe_block": True, "num_experts": 32, "top_k_experts": 4, "moe_intermediate_size": 512,
           "hidden_size_per_layer_input": 0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}
    (root / "m").mkdir()
    (root / "m" / "config.json").write_text(json.dumps(cfg))
    out = {}
    for batch in (1, 8):
        prompts = [{"prompt_token_ids": list(range(3, 3 + 256))} for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for mode in ("eager", "compiled"):
            llm = LLM(str(root / "m"), device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                      enforce_eager=mode == "eager", max_model_len=1024, max_num_seqs=8,
                      cudagraph_batch_sizes="1,8")
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, params)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            out[f"{mode}/batch{batch}"] = dt / 64 * 1000
            extra = ""
            if mode == "compiled":
                s = llm.engine.executor.runner.compiler.summary()
                extra = f" whole-graph={s['whole_graph_decode_sizes']} decode ms {s['decode_timings_ms']}"
            print(f"speed {mode:8s} batch {batch}: {dt / 64 * 1000:.2f} ms/step (256-token prompts, 64 steps){extra}",
                  flush=True)
            del llm
    RESULTS["speed_ms_per_step"] = out
    return True


def structured(device: str = "cuda", eager: bool = False) -> bool:
    """Structured output on a compiled engine with --jit-monitor error: JSON-constrained rows beside free ones,
    all rows constrained, one row alone. xgrammar's mask kernel is Triton on CUDA; warm-up builds its variants
    (runtime/structured_output.py), so none may build inside a step (that would raise here)."""
    import json as jsonlib

    from compiled_llm import LLM, SamplingParams
    from tiny_models import make_checkpoint

    try:
        import xgrammar  # noqa: F401
    except ImportError:
        print("structured: xgrammar is not installed here (carry its wheel: ../shared/gpu/wheels.sh xgrammar)")
        RESULTS["structured"] = "no xgrammar"
        return False
    root = Path(tempfile.mkdtemp())
    make_checkpoint(root / "dense", "dense")
    llm = LLM(str(root / "dense"), device=device, enforce_eager=eager, jit_monitor="error", block_size=16,
              max_model_len=128, max_num_seqs=20)
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}},
              "additionalProperties": False}
    free = SamplingParams(temperature=0, max_tokens=24)
    constrained = [SamplingParams(temperature=0, max_tokens=40, structured_output=spec)
                   for spec in ({"json": schema}, {"json_object": True})]
    ok = True
    for rows in ([constrained[0], free, constrained[1]], constrained, constrained[:1], [constrained[0]] * 17 + [free]):
        outs = llm.generate([[5, 6, 7, 8 + i] for i in range(len(rows))], rows)
        for out, params in zip(outs, rows):
            if params.structured_output is not None:
                try:
                    ok &= isinstance(jsonlib.loads(out.outputs[0].text), dict)
                except ValueError:
                    ok = False
    from compiled_llm.ops.jit import MONITOR

    RESULTS["structured"] = {"ok": ok, "late_compiles": list(MONITOR.late)}
    print(f"structured output, compiled, jit-monitor error: {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="kernels,models,cache,speed")
    ap.add_argument("--names", default="dense,moe,all,dense32,moe32,all32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ok = True
    for section in args.sections.split(","):
        try:
            ok &= models(args.names.split(",")) if section == "models" else globals()[section]()
        except Exception as e:  # report and go on to the next section
            import traceback

            traceback.print_exc()
            print(f"{section}: EXCEPTION {e!r}", flush=True)
            ok = False
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print("COMPILER GPU CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
