"""Tensor, expert and pipeline parallelism on the CPU: 2 processes talking through gloo.

Each parallel engine must give the same greedy tokens as one process (which equals transformers,
tests/test_gemma4_equivalence.py) and hold only its slice of the weights. The "all" tiny model has
every feature at once (MoE, PLE, shared KV, K=V, mixed head dims, soft-capping); the single-feature
models run under `-m slow`. Engines are started one at a time: a process runs one parallel engine.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.distributed.parallel_state import ParallelState, partition_layers, set_parallel_state
from compiled_llm.runtime.errors import EngineDeadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
_REFERENCE: dict[str, tuple[list, list, dict]] = {}
_SCORES: dict[str, list] = {}


def make_llm(folder, **kw):
    kw.setdefault("enforce_eager", True)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    return LLM(str(folder), **kw)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 19, 33)]


def generate_ids(llm, ps):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]


def reference(tiny_ckpt, name):
    """(prompts, single-process greedy tokens, {parameter: numel}, layout: kv heads per layer and the segment
    sizes of every merged projection)"""
    if name not in _REFERENCE:
        folder, hf = tiny_ckpt(name)
        ps = prompts(hf.config.vocab_size)
        llm = make_llm(folder)
        counts = {n: p.numel() for n, p in llm.engine.executor.runner.model.named_parameters()}
        from compiled_llm.models.parallel_layers import MergedColumnParallelLinear

        model = llm.engine.executor.runner.model
        layout = {"kv_heads": [layer.num_kv_heads for layer in llm.engine.executor.runner.model_config.layers],
                  "merged": {f"{n}.weight": (m.sizes, m.in_features) for n, m in model.named_modules()
                             if isinstance(m, MergedColumnParallelLinear)}}
        _REFERENCE[name] = (ps, generate_ids(llm, ps), counts, layout)
    return _REFERENCE[name]


SCORED = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)


def scores(llm, ps):
    """The longest prompt's prompt logprobs (runtime/prompt_logprobs.py): per token, id -> (logprob, rank)."""
    out = llm.generate([{"prompt_token_ids": ps[-1]}], SCORED)[0]
    return [e and {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in out.prompt_logprobs]


def same_scores(got, want):
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys() and all(g[t][1] == w[t][1] for t in g)
        assert [g[t][0] for t in g] == pytest.approx([w[t][0] for t in g], abs=1e-4)


def reference_scores(tiny_ckpt, name):
    if name not in _SCORES:
        _SCORES[name] = scores(make_llm(tiny_ckpt(name)[0]), reference(tiny_ckpt, name)[0])
    return _SCORES[name]


@pytest.fixture
def parallel_llm(tiny_ckpt):
    """parallel_llm(name, **engine kwargs) -> LLM; shut down after the test."""
    made = []

    def start(name, **kw):
        llm = make_llm(tiny_ckpt(name)[0], **kw)
        made.append(llm)
        return llm

    yield start
    for llm in made:
        llm.engine.shutdown()


# ---- what each rank must hold ------------------------------------------------------------------------
SPLIT = re.compile(r"(qkv_proj|o_proj|gate_up_proj|down_proj|experts\.|embed_tokens|q_proj|k_proj|v_proj)")


def expected_tp2(name: str, full: int, layout: dict) -> int:
    """Parameters of one TP2 rank: half of every split weight, all of the replicated ones (norms,
    router, PLE gates and projections, and the K/V segments of a merged [q; k; v] in layers with a single KV
    head)."""
    m = re.match(r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight", name)
    if m and layout["kv_heads"][int(m.group(1))] == 1:
        sizes, cols = layout["merged"][name]
        return (sizes[0] // 2 + sum(sizes[1:])) * cols
    return full // 2 if SPLIT.search(name) else full


def check_tp2_counts(per_rank: list[dict], full: dict, layout: dict) -> None:
    assert len(per_rank) == 2
    for counts in per_rank:
        assert set(counts) == set(full)
        for name, n in full.items():
            assert counts[name] == expected_tp2(name, n, layout), name
    assert sum(per_rank[0].values()) < sum(full.values())


def check_pp2_counts(per_rank: list[dict], full: dict, info: list[dict]) -> None:
    owned = set()
    for counts, rank in zip(per_rank, info):
        start, end = rank["layers"]
        for name, n in counts.items():
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if m:
                assert start <= int(m.group(1)) < end, f"rank {rank['rank']} holds {name}"
            if name == "lm_head.weight" and name not in full:  # tied: the last stage's copy of the embedding
                assert rank["pp_rank"] == 1 and n == full["model.embed_tokens.weight"]
                continue
            assert n == full[name], name
            owned.add(name)
    assert owned == set(full)  # every weight lives on exactly the stage that needs it
    assert not set(per_rank[0]) & set(per_rank[1]) - {"lm_head.weight"}


# ---- no processes: layer split and stage partition ---------------------------------------------------
def test_partition_layers_even_and_kv_links():
    assert partition_layers(4, 1) == [0, 4]
    assert partition_layers(4, 2) == [0, 2, 4]
    assert partition_layers(7, 2) == [0, 4, 7]  # the extra layer goes to the first stage
    # shared_kv tiny model: layers 4 and 5 read layers 2 and 3, so stage 2 starts at layer 2 at the latest
    assert partition_layers(6, 2, [(2, 4), (3, 5)]) == [0, 2, 6]
    with pytest.raises(ValueError, match="cannot split the 6 layers without separating"):
        partition_layers(6, 4, [(2, 4), (3, 5)])


def test_partition_override(monkeypatch):
    monkeypatch.setenv("COMPILED_LLM_PP_LAYER_PARTITION", "1,3")
    assert partition_layers(4, 2) == [0, 1, 4]
    monkeypatch.setenv("COMPILED_LLM_PP_LAYER_PARTITION", "3,3")
    with pytest.raises(ValueError, match="splits layers that share a KV cache"):
        partition_layers(6, 2, [(2, 4)])


def test_unsupported_settings_are_refused():
    from compiled_llm.config import EngineConfig
    from compiled_llm.models.qwen3_5 import Qwen3_5ForCausalLM
    from compiled_llm.runtime.executor.launch import check_parallel_config

    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM does not support pipeline parallelism yet"):
        check_parallel_config(EngineConfig(pipeline_parallel_size=2), Qwen3_5ForCausalLM)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        check_parallel_config(EngineConfig(tensor_parallel_size=3, nnodes=2))
    with pytest.raises(ValueError, match="node_rank must lie in"):
        check_parallel_config(EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2))


def rank_shards(model_cls, folder, tp: int = 2) -> tuple[object, list[dict]]:
    """The model config and each TP rank's parameters, built and loaded in this process as that rank (loading
    needs no collective)."""
    from compiled_llm.models.loader import load_weights
    from compiled_llm.runtime.model_runner import read_hf_config

    cfg = model_cls.config_from_hf(read_hf_config(folder))
    shards = []
    try:
        for rank in range(tp):
            set_parallel_state(ParallelState(tp_size=tp, tp_rank=rank))
            model = model_cls(cfg)
            load_weights(model, folder, model.hf_to_ours, progress=False)
            shards.append(dict(model.named_parameters()))
    finally:
        set_parallel_state(ParallelState())
    return cfg, shards


def test_rank_slices_reassemble_checkpoint(tiny_ckpt):
    """Built as rank 0 and rank 1 of TP2 (no collectives needed to load), the slices of every weight
    put back together give the checkpoint tensor."""
    from safetensors import safe_open

    from compiled_llm.models.gemma4 import Gemma4ForCausalLM

    folder, _ = tiny_ckpt("all")
    _, shards = rank_shards(Gemma4ForCausalLM, folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        def merged(layer: int, merged_name: str, names: list[str], replicated: tuple = ()) -> None:
            """A merged projection holds [a_r; b_r; ...]: rank r's slice of each checkpoint tensor, in order
            (a tensor with fewer heads than ranks whole on every rank)."""
            full = [f.get_tensor(f"model.layers.{layer}.{n}.weight") for n in names]
            sizes = [t.shape[0] if n in replicated else t.shape[0] // 2 for t, n in zip(full, names)]
            parts = [s[f"model.layers.{layer}.{merged_name}.weight"].split(sizes) for s in shards]
            for j, (t, n) in enumerate(zip(full, names)):
                got = [p[j] for p in parts]
                assert all(torch.equal(g, t) for g in got) if n in replicated else torch.equal(torch.cat(got), t), n

        merged(0, "self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
        merged(0, "mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"])
        # a global K=V layer with one KV head: q split, k replicated, no v
        assert "model.layers.1.self_attn.v_proj.weight" not in f.keys()
        merged(1, "self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj"], replicated=("self_attn.k_proj",))
        o = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
        assert torch.equal(torch.cat([s["model.layers.0.self_attn.o_proj.weight"] for s in shards], 1), o)
        gu = f.get_tensor("model.layers.0.experts.gate_up_proj")  # [E, 2I, H], packed [gate; up]
        i = gu.shape[1] // 2
        parts = [s["model.layers.0.experts.gate_up_proj"] for s in shards]
        assert torch.equal(torch.cat([p[:, :i // 2] for p in parts], 1), gu[:, :i])
        assert torch.equal(torch.cat([p[:, i // 2:] for p in parts], 1), gu[:, i:])
        emb = f.get_tensor("model.embed_tokens.weight")
        assert torch.equal(torch.cat([s["model.embed_tokens.weight"] for s in shards])[:emb.shape[0]], emb)


# ---- two processes -------------------------------------------------------------------------------
def test_tp2_greedy_and_weight_slices(tiny_ckpt, parallel_llm):
    ps, ref, full, layout = reference(tiny_ckpt, "all")
    want = reference_scores(tiny_ckpt, "all")  # (before: one parallel engine a process, and nothing beside it)
    llm = parallel_llm("all", tensor_parallel_size=2)
    assert generate_ids(llm, ps) == ref
    same_scores(scores(llm, ps), want)  # every rank in the LM head's pieces
    executor = llm.engine.executor
    check_tp2_counts(executor.collective_rpc("param_counts"), full, layout)
    specs = executor.runner.specs  # the KV cache is sized for this rank's heads: 2 query heads, 1 KV head
    assert {s.num_heads for s in specs.values()} == {2} and {s.num_kv_heads for s in specs.values()} == {1}
    # shutdown releases the graphs and the KV cache before the group is left (an NCCL abort waited on
    # collectives captured in live CUDA graphs)
    from compiled_llm.runtime.executor import multiproc

    seen = []
    leave = multiproc.destroy_parallel
    multiproc.destroy_parallel = lambda **kw: (seen.append(dict(executor.runner.kv_caches)), leave(**kw))
    try:
        llm.engine.shutdown()
    finally:
        multiproc.destroy_parallel = leave
    assert seen == [{}]


def test_tp2_every_rank_freezes_its_heap(tiny_ckpt, parallel_llm, monkeypatch):
    """The engine freezes its own heap after start-up and, through the executor, every other rank's process
    (runtime/heap.py; the suite turns it off elsewhere: COMPILED_LLM_GC_FREEZE=0 in conftest)."""
    import gc

    monkeypatch.setenv("COMPILED_LLM_GC_FREEZE", "1")  # before the workers are spawned: they inherit it
    try:
        llm = parallel_llm("dense", tensor_parallel_size=2)
        assert gc.get_freeze_count() > 0
        assert llm.engine.executor.collective_rpc("freeze_heap") == [True, True]
    finally:
        gc.unfreeze()


def test_tp2_expert_parallel_greedy_and_experts(tiny_ckpt, parallel_llm):
    ps, ref, full, _ = reference(tiny_ckpt, "all")
    llm = parallel_llm("all", tensor_parallel_size=2, enable_expert_parallel=True)
    assert generate_ids(llm, ps) == ref
    per_rank = llm.engine.executor.collective_rpc("param_counts")
    for counts in per_rank:  # whole experts, half of them each
        for name in (n for n in full if ".experts." in n):
            assert counts[name] == full[name] // 2
    experts = llm.engine.executor.runner.model.model.layers[0].experts
    assert (experts.num_local_experts, experts.first_expert, experts.local_intermediate) == (2, 0, 16)


def test_expert_parallel_all_to_all_dispatch(tiny_ckpt, parallel_llm, monkeypatch):
    monkeypatch.setenv("COMPILED_LLM_MOE_DISPATCH", "all_to_all")  # the spawned worker inherits it
    ps, ref, _, _ = reference(tiny_ckpt, "moe")
    llm = parallel_llm("moe", tensor_parallel_size=2, enable_expert_parallel=True)
    assert llm.engine.executor.runner.model.model.layers[0].experts.use_all_to_all(1)
    assert generate_ids(llm, ps) == ref


def test_pp2_greedy_and_stage_weights(tiny_ckpt, parallel_llm, caplog):
    """PLE per-layer inputs and hidden states cross the stage boundary; the KV-sharing layers (5, 6)
    stay on the stage of their sources (3, 4); the tied embedding feeds the last stage's head. Async
    scheduling, asked for, is refused with the reason (pipeline stages step synchronously)."""
    ps, ref, full, _ = reference(tiny_ckpt, "all")
    want = reference_scores(tiny_ckpt, "all")
    llm = parallel_llm("all", pipeline_parallel_size=2, async_scheduling=True)
    assert not llm.engine.async_scheduling
    assert any("async scheduling is off: pipeline-parallel" in r.getMessage() for r in caplog.records)
    assert generate_ids(llm, ps) == ref
    same_scores(scores(llm, ps), want)  # packed rows from the last stage to rank 0
    executor = llm.engine.executor
    info = executor.collective_rpc("info")
    assert [i["layers"] for i in info] == [(0, 3), (3, 7)]
    check_pp2_counts(executor.collective_rpc("param_counts"), full, info)


@pytest.mark.slow  # suite time: runs in `make test-slow` (37 s; compiled PP2 was checked on two H200s, session 6)
def test_pp2_compiled_equals_eager(tiny_ckpt, parallel_llm):
    """Each stage compiles its own layers with the fusion passes (fusion_check=error: every layer of the stage
    gets its declared fusions); hidden states and PLE per-layer inputs cross as the compiled forward's inputs
    and outputs; greedy tokens equal one eager process."""
    ps, ref, _, _ = reference(tiny_ckpt, "ple")
    llm = parallel_llm("ple", pipeline_parallel_size=2, enforce_eager=False, fusion_check="error", jit_monitor="error",
                       cudagraph_batch_sizes="2", compile_sizes="all")
    assert generate_ids(llm, ps) == ref
    summaries = llm.engine.executor.collective_rpc("compiler_summary")
    assert len(summaries) == 2
    for s in summaries:
        assert s["pieces"] >= 2 and s["passes"]["qk_norm_rope_kv_write"]["matches"] >= 1
        assert s["static_sizes"] == [2]


def test_killed_worker_fails_fast(tiny_ckpt, parallel_llm):
    ps, ref, _, _ = reference(tiny_ckpt, "dense")
    llm = parallel_llm("dense", tensor_parallel_size=2)
    assert generate_ids(llm, ps[:1]) == ref[:1]
    assert llm.engine.is_healthy()
    pid = llm.engine.executor.worker_pids()[1]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=rf"worker rank 1 \(pid {pid}\) was killed by SIGKILL"):
        generate_ids(llm, ps)
    assert time.monotonic() - start < 10
    assert not llm.engine.is_healthy()
    with pytest.raises(EngineDeadError):  # and it stays dead, without waiting
        llm.engine.step()


@pytest.mark.slow  # 28 s; the pass on two ranks: test_allreduce_pass.py; compiled ranks with jit_monitor: PP2
def test_tp2_allreduce_rms_norm_pass_fires(tiny_ckpt, parallel_llm):
    """Compiled under TP2, each row-parallel all-reduce that an RMSNorm follows becomes one
    allreduce_rms_norm op, on every rank, and the tokens stay the same."""
    pytest.importorskip("compiled_llm.passes.allreduce_rms_norm", reason="the allreduce_rms_norm pass is not there")
    ps, ref, _, _ = reference(tiny_ckpt, "dense")
    # jit_monitor error: a compile after warm-up on any rank kills the run (the step's tensors once failed the
    # compiled forward's guard on every rank: ordinary tensors where warm-up had inference tensors)
    llm = parallel_llm("dense", tensor_parallel_size=2, enforce_eager=False, compile_passes="allreduce_rms_norm",
                       jit_monitor="error")
    assert generate_ids(llm, ps[:2]) == ref[:2]
    layers = len(ref and reference(tiny_ckpt, "dense")[3])
    for summary in llm.engine.executor.collective_rpc("compiler_summary"):
        # per layer: o_proj -> post_attention_layernorm, down_proj -> post_feedforward_layernorm
        assert summary["passes"]["allreduce_rms_norm"]["matches"] >= 2 * layers


# ---- slow: every single-feature model in every mode ---------------------------------------------------
MODES = {"tp2": dict(tensor_parallel_size=2), "tp2_ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
         "pp2": dict(pipeline_parallel_size=2)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["dense", "moe", "ple", "shared_kv", "k_eq_v", "mixed_heads"])
def test_every_model_every_mode(tiny_ckpt, parallel_llm, name, mode):
    if mode == "tp2_ep" and name != "moe":
        pytest.skip("expert parallelism needs experts")
    ps, ref, full, layout = reference(tiny_ckpt, name)
    llm = parallel_llm(name, **MODES[mode])
    assert generate_ids(llm, ps) == ref
    counts = llm.engine.executor.collective_rpc("param_counts")
    if mode == "tp2":
        check_tp2_counts(counts, full, layout)
    elif mode == "pp2":
        check_pp2_counts(counts, full, llm.engine.executor.collective_rpc("info"))


@pytest.mark.slow
def test_tp2_pp2_four_processes(tiny_ckpt, parallel_llm):
    ps, ref, _, _ = reference(tiny_ckpt, "all")
    llm = parallel_llm("all", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert generate_ids(llm, ps) == ref


# ---- slow: the command line ---------------------------------------------------------------------------
@pytest.mark.slow
def test_serve_tp2_on_cpu(tiny_ckpt):
    import httpx

    from server_utils import ServerProcess

    folder, _ = tiny_ckpt("dense")
    ref = make_llm(folder).generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True))[0].outputs[0].text
    server = ServerProcess("--model", str(folder), "-tp", "2", "--enforce-eager", "--max-model-len", "128")
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": folder.name, "prompt": "The quick brown fox", "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref
        assert server.terminate() == 0
    finally:
        server.kill()


@pytest.mark.slow
def test_torchrun_ranks(tiny_ckpt):
    """torchrun starts both ranks; rank 0 runs the engine, rank 1 the worker loop."""
    import json
    import subprocess
    import sys

    from server_utils import free_port

    folder, _ = tiny_ckpt("dense")
    ref = make_llm(folder).generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True))[0].outputs[0]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "-m", "compiled_llm", "generate", "--model", str(folder), "-tp", "2",
                          "--enforce-eager", "--max-model-len", "128", "--temperature", "0", "--max-tokens", "8",
                          "--ignore-eos", "--json", "The quick brown fox"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["token_ids"] for r in rows] == [ref.token_ids]


@pytest.mark.slow
def test_tp2_and_pp2_with_an_image(tmp_path):
    """Every rank of the first stage registers the image once and runs the towers itself; the steps carry
    only references (under PP the later stage keeps nothing). Tokens equal the one-process run."""
    from multimodal_tiny import image, make_mm_checkpoint

    make_mm_checkpoint(tmp_path, audio=False)
    prompt = {"prompt": "The quick <|image|> brown fox", "multi_modal_data": {"image": image(1)}}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(str(tmp_path), enforce_eager=True, max_model_len=320, block_size=8).generate(prompt, params)
    for kw, held in ((dict(tensor_parallel_size=2), [["held"], ["held"]]), (dict(pipeline_parallel_size=2),
                                                                          [["held"], []])):
        llm = LLM(str(tmp_path), enforce_eager=True, max_model_len=320, block_size=8, **kw)
        try:
            assert llm.generate(prompt, params)[0].outputs[0].token_ids == ref[0].outputs[0].token_ids, kw
            llm.engine.add_request("held", prompt, params)
            assert llm.engine.executor.collective_rpc("media_requests") == held
            llm.engine.abort_request("held")
            assert llm.engine.executor.collective_rpc("media_requests") == [[], []]
        finally:
            llm.engine.shutdown()


@pytest.mark.slow
def test_tp2_media_registration_rolls_back_and_releases(tmp_path, monkeypatch):
    """Rank 1 refuses one request's media (the test hook): the request fails with rank 1's own message, rank 0
    rolls back, the engine stays healthy and the next image requests (preempted ones among them) give the
    single-process tokens. Once requests end (finish or abort) every rank's registry and /dev/shm are empty."""
    from compiled_llm.multimodal import transport
    from compiled_llm.runtime.executor.worker import MEDIA_FAULT_ENV
    from multimodal_tiny import image, make_mm_checkpoint

    make_mm_checkpoint(tmp_path, audio=False)
    monkeypatch.setenv(MEDIA_FAULT_ENV, "1:bad")  # the spawned worker inherits it
    text = "The quick brown fox <|image|> jumps over the lazy dog"
    prompts = [{"prompt": text, "multi_modal_data": {"image": image(i)}} for i in (1, 2)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(enforce_eager=True, max_model_len=200, block_size=8, num_kv_blocks=30, enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **kw).generate(prompts, params)]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **kw)
    try:
        executor = llm.engine.executor
        with pytest.raises(ValueError, match="on rank 1: RuntimeError: media registration fault injected on rank 1"):
            llm.engine.add_request("bad", prompts[0], params)
        assert executor.collective_rpc("media_requests") == [[], []]
        assert llm.engine.is_healthy() and not llm.engine.has_unfinished_requests()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
        assert llm.engine.scheduler.num_preemptions > 0  # a preempted request kept its registration
        assert executor.collective_rpc("media_requests") == [[], []]
        llm.engine.add_request("aborted", prompts[1], params)
        assert executor.collective_rpc("media_requests") == [["aborted"], ["aborted"]]
        llm.engine.step()
        llm.engine.abort_request("aborted")
        assert executor.collective_rpc("media_requests") == [[], []]
        assert not [n for n in os.listdir(transport.SHM_DIR) if n.startswith(f"{transport.PREFIX}{os.getpid()}-")]
    finally:
        llm.engine.shutdown()


def test_symm_mem_allreduce_is_refused_where_it_cannot_run():
    """--tp-allreduce symm-mem is a CUDA, tensor-parallel, compiled setting: elsewhere a clear error at once
    (test_cli.py: the same as a one-line CLI error)."""
    from compiled_llm.config import EngineConfig

    with pytest.raises(ValueError, match="tp_allreduce must be nccl or symm-mem"):
        EngineConfig(tp_allreduce="gloo")
    with pytest.raises(ValueError, match="symm-mem needs CUDA, tensor_parallel_size > 1"):
        EngineConfig(device="cpu", tensor_parallel_size=2, tp_allreduce="symm-mem")
    assert EngineConfig(device="cpu", tensor_parallel_size=2).tp_allreduce == "nccl"


def test_nccl_groups_are_aborted_not_destroyed(monkeypatch):
    """NCCL's graceful destroy waits on its peers (it hung at shutdown on two H200s, and so did the abort that a
    watchdog thread started beside it): an NCCL group is aborted, which is local; gloo keeps the graceful destroy."""
    import torch.distributed as dist

    from compiled_llm.distributed import parallel_state

    calls = []
    state = {"up": True}
    monkeypatch.setattr(dist, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (calls.append("destroy"), state.update(up=False)))
    monkeypatch.setattr(parallel_state, "abort_parallel", lambda: (calls.append("abort"), state.update(up=False)))
    for backend, want in (("nccl", ["abort"]), ("gloo", ["destroy"])):
        calls.clear()
        state["up"] = True
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        parallel_state.destroy_parallel(timeout=10.0)
        assert calls == want, (backend, calls)
