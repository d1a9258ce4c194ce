"""Parallel engine on 2+ GPUs (NCCL): TP2, PP2 and TP2+EP greedy tokens equal one GPU's, a killed worker
gives EngineDeadError, and the compiled TP2 run (CUDA Graphs, allreduce_rms_norm) gives the same tokens.

    python scripts/check_parallel_gpu.py CKPT modes      # eager: TP2, PP2, TP2+EP, killed worker
    python scripts/check_parallel_gpu.py CKPT compiled   # compiled TP1, TP2, TP2+EP and PP2, per-rank pass matches
    python scripts/check_parallel_gpu.py CKPT compiled pp2,tp2ep   # only those (tp1, tp2, tp2ep, tp2ep_a2a, pp2)
    python scripts/check_parallel_gpu.py CKPT kill_compiled   # a worker killed under compiled TP2, shutdown timed
    python scripts/check_parallel_gpu.py CKPT bf16 [modes]   # bfloat16: tokens vs one GPU eager, first divergence
                                                            # with both sides' top-1 - top-2 logprob gaps there
(tp2ep_a2a: expert parallel with all-to-all dispatch, COMPILED_LLM_MOE_DISPATCH=all_to_all: an eager path; compiled,
the MoE is the routed op and one all-reduce, so there it runs as tp2ep. CHECK_DEVICE=cpu runs the script's logic on
the CPU over gloo.)

CKPT: a tiny float32 checkpoint, e.g. `python -c "import sys; sys.path.insert(0, 'tests'); from pathlib import
Path; from tiny_models import make_checkpoint; make_checkpoint(Path('/tmp/ckpt_all'), 'all')"`.
"""
import gc, os, sys, time, signal, threading
import torch
from compiled_llm import LLM, SamplingParams
from compiled_llm.runtime.errors import EngineDeadError

G = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
G2 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)  # the top-2 at each token
DEVICE = os.environ.get("CHECK_DEVICE", "cuda")
MODES = {"tp2": dict(tensor_parallel_size=2), "tp2ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
         "tp2ep_a2a": dict(tensor_parallel_size=2, enable_expert_parallel=True),
         "pp2": dict(pipeline_parallel_size=2)}  # compiled, CUDA graphs; PP: each stage its own graphs


def gap(step: dict) -> float:
    """top-1 minus top-2 logprob at one generated token (how near a tie the greedy pick was)."""
    top = sorted((lp.logprob for lp in step.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def divergence(ref, got) -> str:
    """Where the first sequence that differs departs, with the top-2 gap on both sides there."""
    for i, (a, b) in enumerate(zip(ref, got)):
        j = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if j is not None:
            return (f"prompt {i} token {j}: {a.token_ids[j]} vs {b.token_ids[j]}; top-2 gap one GPU "
                    f"{gap(a.logprobs[j]):.4f}, this run {gap(b.logprobs[j]):.4f}")
    return "none"

def kill_check(llm) -> None:
    """Kills rank 1 one second into a run of decodes: the engine must say so within seconds, and its shutdown
    (graphs, KV cache, the fused kernel's abort, the process group) must return within seconds too."""
    pid = llm.engine.executor.worker_pids()[1]
    killed = []

    def kill():
        killed.append(time.time())
        os.kill(pid, signal.SIGKILL)

    threading.Timer(1.0, kill).start()
    long = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)  # prompt + 90 < max_model_len 128
    prompts = [{"prompt_token_ids": [5 + i] * (3 + 7 * i)} for i in range(3)]
    try:
        for _ in range(200):  # generates back to back until the kill lands in one
            llm.generate(prompts, long)
        print("NO ERROR after kill")
    except EngineDeadError as e:
        print("killed during decode: EngineDeadError %.1fs after the kill: %s" % (time.time() - killed[0], e), flush=True)
    print("healthy", llm.engine.is_healthy())
    t = time.time()
    llm.engine.shutdown()
    print("shutdown after the kill in %.1fs" % (time.time() - t), flush=True)


def main():
    print("torch", torch.__version__, "gpus", torch.cuda.device_count(), flush=True)
    ck = sys.argv[1]
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 290, (n,), generator=g).tolist() for n in (5, 19, 33)]

    def run(keep=False, params=G, mode=None, **kw):
        t = time.time()
        os.environ["COMPILED_LLM_MOE_DISPATCH"] = "all_to_all" if mode == "tp2ep_a2a" else "auto"  # workers inherit it
        llm = LLM(ck, device=DEVICE, max_model_len=128, max_num_seqs=4, **kw)  # static sizes 1, 2, 4
        t1 = time.time()
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
        out = outs if params is not G else [o.token_ids for o in outs]
        t2 = time.time()
        llm.generate([{"prompt_token_ids": p} for p in ps], params)
        print(kw, "init %.1fs gen %.2fs again %.2fs" % (t1 - t, t2 - t1, time.time() - t2), flush=True)
        if keep:
            return llm, out
        llm.engine.shutdown()
        del llm  # the next engine measures free memory: this one's KV cache must be gone first
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return out

    phase = sys.argv[2]
    if phase == "bf16":  # no float32 reference needed: the one-GPU bf16 eager run is the reference
        ref16 = run(params=G2, enforce_eager=True, dtype="bfloat16")
        for m in sys.argv[3].split(",") if len(sys.argv) > 3 else ["tp1", *MODES]:
            got = run(params=G2, mode=m, enforce_eager=False, dtype="bfloat16", **MODES.get(m, {}))
            same = sum(a.token_ids == b.token_ids for a, b in zip(ref16, got))
            print(f"bf16 compiled {m}: {same}/{len(ref16)} sequences equal; first divergence: {divergence(ref16, got)}",
                  flush=True)
        return
    ref = run(enforce_eager=True)
    if phase == "modes":
        for m in ("tp2", "pp2", "tp2ep", "tp2ep_a2a"):
            got = run(mode=m, enforce_eager=True, **MODES[m])
            print("MATCH" if got == ref else f"DIFF {got} vs {ref}", m, flush=True)
        kill_check(run(keep=True, enforce_eager=True, tensor_parallel_size=2)[0])
    if phase == "kill_compiled":  # compiled TP2 (the fused all-reduce + RMSNorm kernel waits on its peer)
        kill_check(run(keep=True, enforce_eager=False, tensor_parallel_size=2)[0])
    if phase == "compiled":
        chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else ["tp1", *MODES]
        if "tp1" in chosen:
            ref_c = run(enforce_eager=False)
            print("compiled tp1 vs eager:", "MATCH" if ref_c == ref else "DIFF")
        for m in (m for m in chosen if m in MODES):
            llm, got = run(keep=True, mode=m, enforce_eager=False, fusion_check="error", **MODES[m])
            print("compiled", m, "MATCH" if got == ref else f"DIFF {got} vs {ref}", flush=True)
            for s in llm.engine.executor.collective_rpc("compiler_summary"):
                print({k: v for k, v in s.items() if k not in ("counters", "warmup_seconds")}, flush=True)
            llm.engine.shutdown()
            del llm  # the next engine measures free memory: this one's KV cache must be gone first
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
