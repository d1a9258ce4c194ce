#!/usr/bin/env python
"""On the GPU: are runtime/kernel_check.py's CPU-recorded builds the builds the GPU's own launches make?

1. Every Triton launch start-up warm-up makes for the config (recorded on CPU tensors, as
   `compile-cache --dry-run --kernels` does), built for sm_90 into Triton's on-disk cache (a fresh one).
2. The same JIT registry keys compiled the engine's way, by start-up's own parallel build on CUDA tensors
   (compiler/warmup.py precompile_kernels, one worker).
Triton's compile listener counts, per kernel name, the builds of step 2 that its cache answered (built in step 1
with the same specialisation) and those it had to build (a specialisation the CPU recording missed).

    python scripts/kernel_check_gpu.py [--config gemma-4-26b-a4b] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton_cache_"))  # before triton's import

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from configs import config_dict  # noqa: E402

from compiled_llm.compiler.warmup import precompile_kernels  # noqa: E402
from compiled_llm.runtime.kernel_check import check_launch, engine_launches, h100_facts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gemma-4-26b-a4b")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from triton import knobs

    hits, builds = Counter(), Counter()
    builds_by_step: dict[str, list] = {"cpu": [], "cuda": []}  # (name, specialisation) of each build, by step
    step = ["cpu"]

    def spec_of(src) -> dict:
        return {"signature": {k: str(v) for k, v in dict(getattr(src, "signature", {})).items()},
                "constants": {str(k): repr(v) for k, v in dict(getattr(src, "constants", {})).items()},
                "attrs": {str(k): repr(v) for k, v in dict(getattr(src, "attrs", {})).items()}}

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        name = getattr(src, "name", "kernel")
        if step[0] == "cuda":
            (hits if cache_hit else builds)[name] += 1
        if step[0] == "cpu" or not cache_hit:
            builds_by_step[step[0]].append((name, spec_of(src)))

    assert hasattr(knobs, "compilation") and hasattr(knobs.compilation, "listener"), "needs triton >= 3.4"
    knobs.compilation.listener = listener

    t0 = time.time()
    launches = engine_launches(config_dict(a.config))
    built = [check_launch(lz, usage=False) for lz in launches]
    failed = [b.row() for b in built if b.error]
    print(f"step 1: {len(built)} launches recorded on CPU tensors and built for sm_90 in {time.time() - t0:.1f}s;"
          f" {len(failed)} failed", flush=True)
    for row in failed:
        print("  " + row)

    step[0] = "cuda"
    t0 = time.time()
    with h100_facts(config_dict(a.config)) as facts:  # the engine's own parallel build, one worker
        assert precompile_kernels(facts, torch.device("cuda"), workers=1) > 0, "start-up's parallel build did not run"
    torch.cuda.synchronize()
    print(f"step 2: the registry's keys compiled on CUDA tensors in {time.time() - t0:.1f}s: "
          f"{sum(hits.values())} answered by step 1's builds, {sum(builds.values())} built anew", flush=True)
    for name in sorted(set(hits) | set(builds)):
        print(f"  {name:<30} cache hits {hits[name]:3d}  built {builds[name]:3d}")
    diffs = []
    for name, spec in builds_by_step["cuda"]:  # each new build against the CPU builds of the same kernel: what differs
        best = None
        for other_name, other in builds_by_step["cpu"]:
            if other_name != name:
                continue
            d = {part: {k: (other[part].get(k), v) for k, v in spec[part].items() if other[part].get(k) != v}
                 for part in spec}
            d = {part: v for part, v in d.items() if v}
            if best is None or sum(map(len, d.values())) < sum(map(len, best.values())):
                best = d
        diffs.append(dict(kernel=name, nearest_cpu_build_differs=best))
        print(f"  new build {name}: nearest CPU build differs in {json.dumps(best)[:700]}")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(config=a.config, device=torch.cuda.get_device_name(),
                                               recorded=len(built), failed=failed, hits=dict(hits),
                                               builds=dict(builds), diffs=diffs), indent=1))
    return 1 if failed or builds else 0


if __name__ == "__main__":
    sys.exit(main())
