"""A scoring request (an evaluation harness's log-likelihood: `echo` with `logprobs`, i.e.
SamplingParams.prompt_logprobs) against a plain prefill of the same prompt: time and peak memory. The prompt's
logit rows (prompt_logprobs.PIECE_ROWS at a time, float32 [rows, vocab] and their log-softmax) are not in
start-up's memory plan, so the peak over the plain prefill is what a long scored prompt adds; the time ratio is
what scoring costs per prompt token. Prefix caching is off, so each run computes its whole prompt.

    python benchmarks/scoring.py --config gemma-4-26b-a4b --prompt-len 4096
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from configs import add_model_args, model_folder  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402


def _peak(device: str, reset: bool = False) -> int:
    import torch

    if not device.startswith("cuda"):
        return 0
    torch.cuda.synchronize()
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.max_memory_allocated()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    llm = LLM(model_folder(args), device=args.device, dtype=args.dtype, load_format=args.load_format,
              skip_tokenizer_init=True, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False)
    vocab = llm.engine.input_processor.vocab_size
    gen = torch.Generator().manual_seed(0)
    result = {"config": args.model or args.config, "device": args.device, "prompt_len": args.prompt_len, "runs": []}
    for run in range(args.runs + 1):  # the first pair warms up
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
        row = {}
        for name, extra in (("plain", {}), ("scoring", {"prompt_logprobs": 1})):
            _peak(args.device, reset=True)
            t0 = time.perf_counter()
            out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, **extra))[0]
            _peak(args.device)
            row[f"{name}_s"] = round(time.perf_counter() - t0, 4)
            row[f"{name}_peak_bytes"] = _peak(args.device)
            if extra:
                row["entries"] = len(out.prompt_logprobs)
        row["time_ratio"] = round(row["scoring_s"] / row["plain_s"], 3)
        if run:
            print(json.dumps(row), flush=True)
            result["runs"].append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
