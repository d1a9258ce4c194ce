"""Parallel engine on 2+ GPUs (NCCL): TP2, PP2 and TP2+EP greedy tokens equal one GPU's, a killed worker
gives EngineDeadError, and the compiled TP2 run (CUDA Graphs, allreduce_rms_norm) gives the same tokens.

    python scripts/check_parallel_gpu.py CKPT modes      # eager: TP2, PP2, TP2+EP, killed worker
    python scripts/check_parallel_gpu.py CKPT compiled   # compiled TP1, TP2, TP2+EP and PP2, per-rank pass matches
    python scripts/check_parallel_gpu.py CKPT compiled pp2,tp2ep   # only those (tp1, tp2, tp2ep, pp2)

CKPT: a tiny float32 checkpoint, e.g. `python -c "import sys; sys.path.insert(0, 'tests'); from pathlib import
Path; from tiny_models import make_checkpoint; make_checkpoint(Path('/tmp/ckpt_all'), 'all')"`.
"""
import gc, os, sys, time, signal, threading
import torch
from compiled_llm import LLM, SamplingParams
from compiled_llm.runtime.errors import EngineDeadError

G = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

def main():
    print("torch", torch.__version__, "gpus", torch.cuda.device_count(), flush=True)
    ck = sys.argv[1]
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 290, (n,), generator=g).tolist() for n in (5, 19, 33)]

    def run(keep=False, **kw):
        t = time.time()
        llm = LLM(ck, device="cuda", max_model_len=128, max_num_seqs=4, **kw)  # static sizes 1, 2, 4
        t1 = time.time()
        out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], G)]
        t2 = time.time()
        llm.generate([{"prompt_token_ids": p} for p in ps], G)
        print(kw, "init %.1fs gen %.2fs again %.2fs" % (t1 - t, t2 - t1, time.time() - t2), flush=True)
        if keep:
            return llm, out
        llm.engine.shutdown()
        del llm  # the next engine measures free memory: this one's KV cache must be gone first
        gc.collect()
        torch.cuda.empty_cache()
        return out

    phase = sys.argv[2]
    ref = run(enforce_eager=True)
    if phase == "modes":
        for kw in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                   dict(tensor_parallel_size=2, enable_expert_parallel=True)):
            got = run(enforce_eager=True, **kw)
            print("MATCH" if got == ref else f"DIFF {got} vs {ref}", kw, flush=True)
        llm, got = run(keep=True, enforce_eager=True, tensor_parallel_size=2)
        pid = llm.engine.executor.worker_pids()[1]
        killed = []
        def kill():  # during a decode: the generate below is well past its prefill when this fires
            killed.append(time.time())
            os.kill(pid, signal.SIGKILL)
        threading.Timer(1.0, kill).start()
        long = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)  # prompt + 90 < max_model_len 128
        try:
            for _ in range(30):  # generates back to back until the kill lands in one
                llm.generate([{"prompt_token_ids": p} for p in ps], long)
            print("NO ERROR after kill")
        except EngineDeadError as e:
            print("killed during decode: EngineDeadError %.1fs after the kill: %s" % (time.time() - killed[0], e), flush=True)
        print("healthy", llm.engine.is_healthy())
        llm.engine.shutdown()
    if phase == "compiled":
        modes = {"tp2": dict(tensor_parallel_size=2), "tp2ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
                 "pp2": dict(pipeline_parallel_size=2)}  # compiled, CUDA graphs; PP: each stage its own graphs
        chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else ["tp1", *modes]
        if "tp1" in chosen:
            ref_c = run(enforce_eager=False)
            print("compiled tp1 vs eager:", "MATCH" if ref_c == ref else "DIFF")
        for kw in (modes[m] for m in chosen if m in modes):
            llm, got = run(keep=True, enforce_eager=False, fusion_check="error", **kw)
            print("compiled", kw, "MATCH" if got == ref else f"DIFF {got} vs {ref}", flush=True)
            for s in llm.engine.executor.collective_rpc("compiler_summary"):
                print({k: v for k, v in s.items() if k not in ("counters", "warmup_seconds")}, flush=True)
            llm.engine.shutdown()
            del llm  # the next engine measures free memory: this one's KV cache must be gone first
            gc.collect()
            torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
