"""Serving: requests/s, time to first token and time per output token (p50, p99) at a fixed concurrency,
against a running server (python -m compiled_llm serve ...).

    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --concurrency 32 --requests 256 \
        --input-len 1024 --output-len 128

Prompts are random token ids sent to /v1/completions with streaming, greedy, EOS ignored. Before the timed run,
one untimed wave (--warmup-requests, default the concurrency: prompts of the same length, 8 tokens out) takes the
server's first-request costs, as vLLM's `bench serve` sends a test request first (session 36 on the H200: without
it the first wave's TTFT was 918 ms against a p50 of 146).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


async def one_request(client, model: str, prompt: list[int], output_len: int) -> dict:
    start = time.perf_counter()
    first = None
    times = []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            times.append(now)
    end = time.perf_counter()
    tokens = max(1, len(times))
    gaps = [b - a for a, b in zip(times, times[1:])]  # inter-token gaps: a stall shows here, not in the mean
    return {"ttft": (first or end) - start, "tpot": (end - (first or end)) / max(1, tokens - 1), "latency": end - start,
            "gaps": gaps}


async def run(args) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", max_retries=0, timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(args.input_len)] for _ in range(args.requests)]
    sem = asyncio.Semaphore(args.concurrency)

    async def bounded(p):
        async with sem:
            return await one_request(client, model, p, args.output_len)

    warm = args.concurrency if args.warmup_requests is None else args.warmup_requests
    warm_prompts = [[rng.randrange(10, args.vocab) for _ in range(args.input_len)] for _ in range(warm)]
    warmup = await asyncio.gather(*(one_request(client, model, p, min(8, args.output_len)) for p in warm_prompts))
    t = time.perf_counter()
    results = await asyncio.gather(*(bounded(p) for p in prompts))
    elapsed = time.perf_counter() - t
    ttft = [r["ttft"] * 1000 for r in results]
    tpot = [r["tpot"] * 1000 for r in results]
    gaps = [g * 1000 for r in results for g in r["gaps"]]
    return {
        "requests": args.requests, "concurrency": args.concurrency, "input_len": args.input_len,
        "output_len": args.output_len, "seconds": round(elapsed, 3),
        "requests_per_s": round(args.requests / elapsed, 3),
        "output_tok_per_s": round(args.requests * args.output_len / elapsed, 1),
        "ttft_ms_p50": round(statistics.median(ttft), 2), "ttft_ms_p99": round(percentile(ttft, 99), 2),
        "tpot_ms_p50": round(statistics.median(tpot), 3), "tpot_ms_p99": round(percentile(tpot, 99), 3),
        "itl_ms_p99": round(percentile(gaps, 99), 2), "itl_ms_max": round(max(gaps, default=float("nan")), 2),
        "warmup_requests": warm, "warmup_ttft_ms": [round(r["ttft"] * 1000, 2) for r in warmup],
        "ttft_ms": [round(x, 2) for x in ttft],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="served model name (default: the first one listed)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=6000, help="prompt ids are drawn from [10, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-requests", type=int, default=None,
                    help="untimed requests sent at once before the run (default: the concurrency; 0: none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("ttft_ms")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
