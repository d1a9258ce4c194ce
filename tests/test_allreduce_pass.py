"""The passes that see a parallel group, under a 2-process gloo tensor-parallel group with expert
parallelism on: Gemma's row-parallel projection (partial sums all-reduced through the functional
collectives) followed by its RMSNorm is matched as all-reduce + RMSNorm (counted and left to Inductor while only
the op's reference can run it); the experts' traceable
sum over this rank's experts (routing matrix sliced to them) is rewritten to the routed geglu_moe op.
Both compute what eager does. Each rank runs this file as a script; pytest starts both and checks their
exit codes."""

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
        assert "matches=1 ok" in out and "geglu_moe ep matches=1 ok" in out, out[-2000:]


def worker(rank: int, store: str) -> None:
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    from compiled_llm.distributed.parallel_state import destroy_parallel, init_parallel
    from compiled_llm.models.layers import RMSNorm
    from compiled_llm.models.parallel_layers import RowParallelLinear
    from compiled_llm.passes.manager import PassManager

    state = init_parallel(rank, 2, 1, True, "gloo", init_method=f"file://{store}")
    torch.manual_seed(0)
    proj, norm = RowParallelLinear(32, 16), RMSNorm(16, 1e-6)
    with torch.no_grad():
        proj.weight.normal_(0, 0.5)
        norm.weight.normal_(1, 0.3)

    def block(x):
        return norm(proj(x)) * 2.0

    from compiled_llm.ops.collective import ALLREDUCE_RMS_NORM

    pm = PassManager(("allreduce_rms_norm",), torch.float32, "cpu", tp_group=state.tp_group_name)
    # only the reference can run the fused op here: the pass counts its match and leaves the all-reduce and
    # the norm to Inductor (an opaque reference call is slower than no pass); the op is never called
    assert pm.unfused == ("allreduce_rms_norm",), pm.unfused
    calls = []
    reference = ALLREDUCE_RMS_NORM.reference()
    ALLREDUCE_RMS_NORM._reference = lambda *a: calls.append(1) or reference(*a)
    compiled = torch.compile(block, backend=lambda gm, ex: compile_fx(gm, ex, config_patches=pm.inductor_config()),
                             fullgraph=True)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(rank))  # this rank's half of the features
    with torch.inference_mode():
        want = block(x)
        got = compiled(x)
    n = counters["inductor"]["compiled_llm.allreduce_rms_norm"]
    assert n == 1, f"the pass counted {n} matches"
    err = (got - want).abs().max().item()
    assert err < 1e-5, err
    assert not calls, "the reference allreduce_rms_norm ran inside the compiled graph"
    print(f"matches={n} ok")
    expert_parallel_moe(rank)
    destroy_parallel()


def expert_parallel_moe(rank: int) -> None:
    from types import SimpleNamespace

    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    from compiled_llm.models.gemma4 import Experts
    from compiled_llm.passes.manager import PassManager

    torch.manual_seed(1)
    experts = Experts(SimpleNamespace(num_experts=8, hidden_size=32, moe_intermediate_size=16, top_k_experts=3))
    assert experts.expert_parallel and experts.num_local_experts == 4 and experts.first_expert == 4 * rank
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    pm = PassManager(("geglu_moe",), torch.float32, "cpu")
    compiled = torch.compile(experts.routed, fullgraph=True,
                             backend=lambda gm, ex: compile_fx(gm, ex, config_patches=pm.inductor_config()))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 32, generator=g)
    weights, ids = torch.topk(torch.softmax(torch.randn(6, 8, generator=g), -1), 3, -1)  # global expert ids
    with torch.inference_mode():
        want = experts.routed(x, weights, ids)  # eager: loops over this rank's picked experts
        got = compiled(x, weights, ids)
    n = counters["inductor"]["compiled_llm.geglu_moe"]
    assert n == 1, f"the geglu_moe pass replaced {n} matches"
    err = (got - want).abs().max().item()
    assert err < 1e-5 and want.abs().max() > 0, err
    print(f"geglu_moe ep matches={n} ok")


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2])
