"""The first requests after start-up against later ones, at the engine (no server): waves of B prompts of P tokens
with O tokens out each, one after another in a fresh engine; each wave's wall time and what the CUDA caching
allocator did during it (cudaMalloc calls, reserved bytes). A first wave slower than the rest is a cost that
start-up's warm-up left to the first user. --max-num-seqs, --enable-prefix-caching and --with-tokenizer bring the
engine closer to a server's (which builds and steps its engine on one thread, as this script does by default);
--thread runs the waves on a thread other than the one that built the engine (on the CPU, OpenMP then makes the
steps 3-4x slower: server/async_engine.py EngineThread).

    python benchmarks/first_wave.py --config gemma-4-26b-a4b --waves 3 --batch 8 --input-len 1024 --output-len 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from configs import add_model_args, model_folder  # noqa: E402
from throughput import random_prompts  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402


def allocator() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    s = torch.cuda.memory_stats()
    return {"cuda_mallocs": s.get("segment.all.allocated", 0), "reserved_bytes": s.get("reserved_bytes.all.current", 0)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--with-tokenizer", action="store_true", help="load the checkpoint's tokenizer (texts detokenized)")
    ap.add_argument("--thread", action="store_true", help="the waves on one thread other than the main one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    folder = model_folder(args)
    t0 = time.perf_counter()
    llm = LLM(folder, device=args.device, dtype=args.dtype, load_format=args.load_format,
              skip_tokenizer_init=not args.with_tokenizer, enable_prefix_caching=args.enable_prefix_caching,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    result = {"config": args.model or args.config, "start_s": round(time.perf_counter() - t0, 1), "waves": []}
    if args.thread:
        import threading

        worker = threading.Thread(target=waves, args=(llm, args, result), name="engine")
        worker.start()
        worker.join()
    else:
        waves(llm, args, result)
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def waves(llm, args, result: dict) -> None:
    import torch

    vocab = llm.engine.executor.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for w in range(args.waves):
        prompts = [{"prompt_token_ids": p} for p in random_prompts(args.batch, args.input_len, vocab, seed=w)]
        before = allocator()
        sync()
        t = time.perf_counter()
        llm.generate(prompts, params)
        sync()
        wave = {"ms": round(1000 * (time.perf_counter() - t), 2)}
        after = allocator()
        wave.update({k: after[k] - before[k] for k in after})
        result["waves"].append(wave)
        print(f"wave {w + 1}: {wave}", flush=True)


if __name__ == "__main__":
    main()
