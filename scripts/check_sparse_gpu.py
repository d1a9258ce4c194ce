"""Sparse KV on a CUDA GPU, tokens: a tiny random Gemma 4 (float32, head dims 32 / 64 so that every layer
takes the Triton kernels), StreamingLLM and OmniKV, compiled with whole-graph decode forced on against the
eager engine: greedy tokens equal, and the decode steps counted that replayed the whole-forward graph
(issue 19). Staggered prompts (one chunk a step) make some steps hold a prompt's last token beside decode
rows: those run the pieces.

    python3 scripts/check_sparse_gpu.py [--methods omnikv,streamingllm] [--out FILE.json]
    python3 scripts/check_sparse_gpu.py --device cpu     # the same on the CPU (no CUDA graphs: 0 whole-graph steps)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "benchmarks")]

from compiled_llm import LLM, SamplingParams  # noqa: E402
from sparse_kv import TINY  # noqa: E402

# benchmarks/sparse_kv.py's tiny Gemma 4 with head dims 32 / 64 (the Triton kernels' smallest), wider
CONFIG = dict(TINY, hidden_size=128, intermediate_size=192, head_dim=32, global_head_dim=64, max_position_embeddings=4096)
METHODS = {"omnikv": dict(sparse_method="omnikv", sparse_sink_tokens=4, omnikv_budget=48, omnikv_recent=8,
                          omnikv_offload=False),
           "streamingllm": dict(sparse_method="streamingllm", sparse_sink_tokens=4, sparse_window=44)}
# OmniKV with its sparse layers' KV in pinned host memory, compiled, against eager OmniKV with all KV on the
# device: the offload changes where the KV is, not the tokens
METHODS["omnikv-offload"] = dict(METHODS["omnikv"], omnikv_offload=True)
REFERENCE = {"omnikv-offload": "omnikv"}


def run(folder: str, device: str, eager: bool, kw: dict, prompts: list[list[int]], out_len: int):
    llm = LLM(folder, device=device, dtype="float32", load_format="dummy", skip_tokenizer_init=True, seed=0,
              enforce_eager=eager, full_graph_decode="on", max_num_seqs=4, max_model_len=1024,
              max_num_batched_tokens=256, enable_prefix_caching=False, **kw)
    comp = llm.engine.executor.runner.compiler
    before = comp.summary().get("whole_graph_replays", 0) if comp is not None else 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True), use_tqdm=False)
    s = comp.summary() if comp is not None else {}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    info = {"whole_graph_sizes": s.get("whole_graph_decode_sizes"),
            "whole_graph_steps": s.get("whole_graph_replays", 0) - before,
            "offloaded_kv_bytes": llm.engine.get_stats().get("omnikv_offloaded_kv_bytes")}
    llm.engine.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens, info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="omnikv,omnikv-offload,streamingllm")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-len", type=int, default=24)
    ap.add_argument("--out")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp()) / "tiny_sparse"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (300, 161, 90, 257)]
    ok, report, refs = True, {}, {}
    for name in args.methods.split(","):
        t0 = time.time()
        reference = REFERENCE.get(name, name)  # eager OmniKV's tokens serve OmniKV and its offload alike: run once
        if reference not in refs:
            refs[reference], _ = run(str(folder), args.device, True, METHODS[reference], prompts, args.out_len)
        ref = refs[reference]
        got, info = run(str(folder), args.device, False, METHODS[name], prompts, args.out_len)
        equal = sum(a == b for a, b in zip(got, ref))
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, ref)]
        good = equal == len(prompts) and (args.device != "cuda" or info["whole_graph_steps"] > 0)
        good &= bool(info["offloaded_kv_bytes"]) == name.endswith("-offload")
        ok &= good
        report[name] = dict(equal=f"{equal}/{len(prompts)}", first_divergence=first, **info,
                            seconds=round(time.time() - t0, 1))
        print(f"{name}: compiled (whole-graph on) vs eager tokens {equal}/{len(prompts)} equal, first divergence "
              f"{first}, whole-graph sizes {info['whole_graph_sizes']}, whole-graph steps {info['whole_graph_steps']}"
              f" -> {'ok' if good else 'FAIL'}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print("SPARSE GPU CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
