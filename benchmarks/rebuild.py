"""Engines built one after another in one process (a notebook, a sweep, a test suite): what each deletion leaves
behind and what each build gets. Per build: start-up seconds, KV blocks, one short generation, then the memory
in use after `del llm; gc.collect()` (CUDA: the caching allocator's allocated bytes; CPU: the process's resident
set). A later build with fewer KV blocks, or memory that grows build after build, means the deleted engine's
tensors are still held (session 38: the parameters' loader methods had made a cycle that start-up's gc.freeze
kept forever).

    python benchmarks/rebuild.py --config gemma-4-26b-a4b --builds 2
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from configs import add_model_args, model_folder  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402


def memory_in_use(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:  # resident pages
        return int(f.read().split()[1]) * 4096


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--builds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    folder = model_folder(args)
    result = {"config": args.model or args.config, "device": args.device,
              "before_bytes": memory_in_use(args.device), "builds": []}
    for _ in range(args.builds):
        t0 = time.perf_counter()
        llm = LLM(folder, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  skip_tokenizer_init=True, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
        build = {"start_s": round(time.perf_counter() - t0, 1),
                 "kv_blocks": llm.engine.get_stats()["num_total_blocks"],
                 "built_bytes": memory_in_use(args.device)}
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        build["tokens"] = out[0].outputs[0].token_ids
        del llm, out
        gc.collect()
        build["after_delete_bytes"] = memory_in_use(args.device)
        print(json.dumps(build), flush=True)
        result["builds"].append(build)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
