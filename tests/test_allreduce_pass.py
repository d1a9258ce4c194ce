"""The all-reduce + RMSNorm pass under a 2-process gloo tensor-parallel group: Gemma's row-parallel
projection (partial sums all-reduced through the functional collectives) followed by its RMSNorm,
compiled with our pass manager, is rewritten to one allreduce_rms_norm op and computes what eager does.
Each rank runs this file as a script; pytest starts both and checks their exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_allreduce_rms_norm_pass_two_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(store)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}:\n{out[-4000:]}"
        assert "matches=1 ok" in out, out[-2000:]


def worker(rank: int, store: str) -> None:
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    from compiled_llm.distributed.parallel_state import destroy_parallel, init_parallel
    from compiled_llm.models.gemma4 import RMSNorm
    from compiled_llm.models.parallel_layers import RowParallelLinear
    from compiled_llm.passes.manager import PassManager

    state = init_parallel(rank, 2, 1, False, "gloo", init_method=f"file://{store}")
    torch.manual_seed(0)
    proj, norm = RowParallelLinear(32, 16), RMSNorm(16, 1e-6)
    with torch.no_grad():
        proj.weight.normal_(0, 0.5)
        norm.weight.normal_(1, 0.3)

    def block(x):
        return norm(proj(x)) * 2.0

    pm = PassManager(("allreduce_rms_norm",), torch.float32, "cpu", tp_group=state.tp_group_name)
    compiled = torch.compile(block, backend=lambda gm, ex: compile_fx(gm, ex, config_patches=pm.inductor_config()),
                             fullgraph=True)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(rank))  # this rank's half of the features
    with torch.inference_mode():
        want = block(x)
        got = compiled(x)
    n = counters["inductor"]["compiled_llm.allreduce_rms_norm"]
    assert n == 1, f"the pass replaced {n} matches"
    err = (got - want).abs().max().item()
    assert err < 1e-5, err
    destroy_parallel()
    print(f"matches={n} ok")


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2])
