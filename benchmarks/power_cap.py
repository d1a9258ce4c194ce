"""The matmul rate over time: floor.py's burst (ten 8K x 8K products, ~14 ms) against the same products run back
to back for seconds, rate per window. The prefill floor divides by the burst's rate; a long prefill (the 8K
prompt's ~140 ms of tensor-core work) runs into the GPU's power limit, where the driver lowers the SM clock
(nvidia-smi's clocks_event_reasons 0x4, software power cap), and every kernel of it, attention included, slows.

    python3 benchmarks/power_cap.py --seconds 3 --out results/power_cap.json
    python3 benchmarks/power_cap.py --device cpu --n 128 --seconds 0.2   # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def sustained_rate(device: str, n: int, seconds: float, window: float = 0.05) -> list[dict]:
    """Back-to-back n x n x n bfloat16 products for `seconds`; one row a window: its end (seconds from the first
    product) and its rate (FLOP/s). Timed by the host after a synchronize at each window's end."""
    dt = torch.bfloat16 if device != "cpu" else torch.float32
    a = torch.randn(n, n, dtype=dt, device=device)
    b = torch.randn(n, n, dtype=dt, device=device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    flop = 2.0 * n ** 3
    a @ b
    sync()
    rows, t0 = [], time.perf_counter()
    t_prev, done = t0, 0
    per_check = 1
    while t_prev - t0 < seconds:
        for _ in range(per_check):
            a @ b
        sync()
        done += per_check
        t = time.perf_counter()
        if t - t_prev >= window:
            rows.append({"t": t - t0, "flops": done * flop / (t - t_prev)})  # not rounded: windows stay >= window apart
            t_prev, done = t, 0
        elif t - t_prev < window / 8:
            per_check *= 2
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rest", type=float, default=2.0, help="idle seconds before each measurement (clocks recover)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from floor import measure_matmul_rate

    time.sleep(a.rest)
    burst = measure_matmul_rate(a.device, a.n) if a.device != "cpu" else None
    time.sleep(a.rest)
    rows = sustained_rate(a.device, a.n, a.seconds)
    tf = [r["flops"] / 1e12 for r in rows]
    first = next((x for r, x in zip(rows, tf) if r["t"] >= 0.15), tf[-1])
    late = [x for r, x in zip(rows, tf) if r["t"] >= a.seconds / 2] or tf
    out = {"device": torch.cuda.get_device_name() if a.device != "cpu" else "cpu", "n": a.n,
           "burst_tflops": burst / 1e12 if burst else None, "first_150ms_tflops": first,
           "second_half_tflops": sum(late) / len(late), "windows": rows}
    print(f"burst (floor.py): {out['burst_tflops'] or 0:.1f} TFLOP/s; sustained at 150 ms {first:.1f}, "
          f"over the second half {out['second_half_tflops']:.1f} ({len(rows)} windows)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
