"""Start-up phases (issue 15): a cold `compile-cache` build in a fresh process, then a start from a copy of the
cache in another folder (relocated), each timed whole and split into its phases as the engine logs them:
model build and weights, the parallel JIT-kernel build, the eager profile step, KV-cache allocation, Dynamo's
trace / our pieces / the first run (or the saved forward's load), the rest of the warm-up (captures, decode
timings, kernel keys), and the compile counters (Inductor FX-graph and AOT-autograd cache hits and misses,
Triton builds and cache hits). Writes benchmarks/results/startup_<model>_<date>.json.

    python3 benchmarks/startup.py --config gemma-4-26b-a4b [--runs cold,warm] [--out DIR] [-- engine flags]
    python3 benchmarks/startup.py --model CKPT --device cpu ...   (any checkpoint folder)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (phase, pattern on the engine's INFO log; the first group is seconds)
PHASES = [
    ("model_ready_s", r"model ready in ([\d.]+)s"),
    ("weights_s", r"loaded \d+ tensors \([\d.]+ GiB\) in ([\d.]+)s"),
    ("kernel_build_parallel_s", r"Triton kernels in parallel in ([\d.]+)s"),
    ("profile_step_s", r"profile run: .* in ([\d.]+)s"),
    ("kv_cache_alloc_s", r"KV cache allocated in ([\d.]+)s"),
    ("forward_loaded_s", r"loaded the compiled forward .* in ([\d.]+)s"),
    ("forward_saved_s", r"compiled the forward ahead of time and saved it .* in ([\d.]+)s"),
    ("compile_s", r"compiled in ([\d.]+)s"),
]


def parse(log: str) -> dict:
    """The phases, first-forward split and counters in one start's output (`compile-cache --report`)."""
    out: dict = {}
    for name, pattern in PHASES:
        m = re.search(pattern, log)
        if m:
            out[name] = float(m.group(1))
    m = re.search(r"first forward: Dynamo's trace ([\d.]+)s \((\d+) nodes\), pieces ([\d.]+)s, run ([\d.]+)s", log)
    if m:
        out.update(dynamo_trace_s=float(m.group(1)), traced_nodes=int(m.group(2)), pieces_s=float(m.group(3)),
                   first_run_s=float(m.group(4)))
    m = re.search(r"compile cache \S+: (\w+)", log)
    out["cache"] = m.group(1) if m else None
    m = re.search(r"forward compiled ahead of time: ([\w ,]+?) \(", log)
    out["ahead_of_time"] = m.group(1) if m else None
    if "compiles this run:" in log:
        line = log.split("compiles this run:")[1].splitlines()[0]
        out["counters"] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
    out["ready_beyond_weights_s"] = round(sum(out.get(k, 0.0) for k in (
        "model_ready_s", "profile_step_s", "kv_cache_alloc_s", "compile_s")) - out.get("weights_s", 0.0), 2)
    return out


def start(model: str, cache: Path, flags: list[str]) -> dict:
    """One start in a fresh process; its wall time (imports and CUDA initialisation included) and phases."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "compiled_llm", "compile-cache", "--model", model, "--out", str(cache), "--report",
           *flags]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"start failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return dict(parse(r.stdout + r.stderr), process_wall_s=round(wall, 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="a preset config (benchmarks/configs.py), dummy weights")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a preset")
    ap.add_argument("--runs", default="cold,warm", help="cold: build the cache; warm: start from a moved copy")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--work", default=None, help="where the caches go (default: a temporary folder)")
    args, flags = ap.parse_known_args(argv)
    flags = [f for f in flags if f != "--"]
    work = Path(args.work or tempfile.mkdtemp(prefix="startup_"))
    if args.config:
        sys.path.insert(0, str(Path(__file__).parent))
        from configs import write_checkpoint_folder

        model = str(write_checkpoint_folder(args.config, work / "model"))
        flags = ["--load-format", "dummy", "--skip-tokenizer-init", *flags]
    elif args.model:
        model = args.model
    else:
        ap.error("--config or --model")
    built, moved = work / "built" / "cc", work / "elsewhere" / "cc"
    result = {"model": args.config or model, "flags": flags, "date": time.strftime("%Y-%m-%d %H:%M")}
    for run in args.runs.split(","):
        if run == "cold":
            shutil.rmtree(built, ignore_errors=True)
            result["cold"] = start(model, built, flags)
        elif run == "warm":
            shutil.rmtree(moved, ignore_errors=True)
            shutil.copytree(built, moved)
            result["warm"] = start(model, moved, flags)
        else:
            ap.error(f"unknown run {run!r}")
        print(f"{run}: " + json.dumps(result[run]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^\w.-]", "_", Path(str(result["model"])).name)
    path = out / f"startup_{name}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
