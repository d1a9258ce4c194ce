"""The GPU KV-cache budget (runtime/memory.py) and the profile run that measures the activation peak.

The arithmetic is tested with made-up numbers; the GPU path of plan_blocks and measure_memory with
torch.cuda's counters replaced by fakes (what is tested is our arithmetic and our decisions, not torch);
the profile run itself runs for real on tiny CPU models. The real peak is measured on the GPU by the
smoke script, which prints `ModelRunner.memory_profile`."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.config import EngineConfig
from compiled_llm.distributed.parallel_state import ParallelState, set_parallel_state
from compiled_llm.runtime.memory import GIB, GPU_MARGIN_BYTES, kv_cache_budget, one_sequence_bytes, sequence_blocks
from compiled_llm.runtime.model_runner import ModelRunner
from qwen3_5_tiny import make_qwen_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# ---- arithmetic --------------------------------------------------------------------------------------
def test_budget_is_a_fraction_of_total_less_weights_activations_and_margin():
    budget = kv_cache_budget(total_bytes=80 * GIB, utilization=0.9, in_use_bytes=20 * GIB,
                             activation_peak_bytes=5 * GIB, need_bytes=GIB, max_model_len=4096,
                             margin_bytes=GIB)
    assert budget == int(80 * GIB * 0.9) - 26 * GIB  # 72 GiB allowed, 26 GiB taken
    # the default margin is what memory_profile reports
    assert kv_cache_budget(80 * GIB, 0.5, 10 * GIB, 0, 0, 1) == 30 * GIB - GPU_MARGIN_BYTES


def test_too_little_memory_for_one_sequence_is_a_one_line_error_naming_the_flags():
    with pytest.raises(ValueError) as e:
        kv_cache_budget(total_bytes=16 * GIB, utilization=0.5, in_use_bytes=6 * GIB, activation_peak_bytes=GIB,
                        need_bytes=2 * GIB, max_model_len=131072, margin_bytes=GIB)
    msg = str(e.value)
    assert "\n" not in msg
    assert "needs 2.00 GiB for one 131072-token sequence" in msg and "only 0.00 MiB is left" in msg
    assert "0.5 x 16.00 GiB total = 8.00 GiB" in msg
    assert "--gpu-memory-utilization" in msg and "--max-model-len" in msg
    # exactly enough is enough
    assert kv_cache_budget(16 * GIB, 0.5, 5 * GIB, GIB, 1 * GIB, 131072, margin_bytes=GIB) == GIB


def test_sequence_blocks_is_the_engines_capacity_rule():
    """One sequence's blocks per group, checked against the engine's own capacity check: that many blocks
    pass it, one fewer fails it."""
    bs, max_len = 16, 100
    assert sequence_blocks(None, max_len, bs) == 8  # 100 tokens: 7 blocks, plus the next token's
    assert sequence_blocks(32, max_len, bs) == 4  # window 32 + a block of slack = 48 tokens
    assert sequence_blocks((32, 4), max_len, bs) == 5  # + one block of sinks
    assert sequence_blocks(512, max_len, bs) == 8  # a window longer than the sequence: the sequence
    assert one_sequence_bytes({None: 10, 32: 3}, max_len, bs) == 8 * 10 + 4 * 3
    from compiled_llm.runtime.kv_plan import check_capacity

    config = EngineConfig(block_size=bs, max_model_len=max_len)
    for group in (None, 32, (32, 4), 512):
        n = sequence_blocks(group, max_len, bs)
        check_capacity(config, {group: n})
        with pytest.raises(ValueError):
            check_capacity(config, {group: n - 1})


# ---- the GPU path, with made-up measurements ---------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_runner(tiny_ckpt):
    folder, _ = tiny_ckpt("all")  # sliding + full groups, K=V, shared KV, MoE, PLE
    return ModelRunner(EngineConfig(model=str(folder), block_size=4, max_num_seqs=4, max_num_batched_tokens=24))


def _as_gpu(monkeypatch, runner, measured: dict) -> list:
    """The runner takes its GPU path, with measure_memory answering `measured`."""
    calls = []
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(runner, "memory_profile", {})
    monkeypatch.setattr(runner, "measure_memory", lambda max_len: calls.append(max_len) or dict(measured))
    return calls


def test_gpu_plan_gives_the_kv_cache_what_is_left_and_records_it(gemma_runner, monkeypatch, caplog):
    r = gemma_runner
    measured = {"total_bytes": 1000 * 2**20 + GPU_MARGIN_BYTES, "in_use_bytes": 300 * 2**20,
                "weights_bytes": 200 * 2**20, "activation_peak_bytes": 100 * 2**20}
    calls = _as_gpu(monkeypatch, r, measured)
    with caplog.at_level("INFO", logger="compiled_llm"):
        counts = r.plan_blocks(64)
    assert calls == [64]
    budget = int(measured["total_bytes"] * 0.9) - (400 * 2**20 + GPU_MARGIN_BYTES)
    prof = r.memory_profile
    assert prof["kv_cache_bytes"] == budget and prof["margin_bytes"] == GPU_MARGIN_BYTES
    assert {k: prof[k] for k in measured} == measured and prof["kv_blocks"] == counts
    used = sum(n * r.group_block_bytes()[g] for g, n in counts.items())
    assert budget - r.group_block_bytes()[None] < used <= budget  # the full group takes all that is left
    assert any("KV cache" in m and "blocks per group" in m and "activation peak 0.10 GiB" in m
               for m in caplog.messages)


def test_gpu_plan_refuses_to_start_when_one_sequence_does_not_fit(gemma_runner, monkeypatch):
    r = gemma_runner
    need = one_sequence_bytes(r.group_block_bytes(), 512, r.block_size)
    total = 2 * GIB
    in_use = int(total * 0.9) - GPU_MARGIN_BYTES - need + 1  # one byte short
    _as_gpu(monkeypatch, r, {"total_bytes": total, "in_use_bytes": in_use, "weights_bytes": 0,
                             "activation_peak_bytes": 0})
    with pytest.raises(ValueError, match="one 512-token sequence.*--gpu-memory-utilization"):
        r.plan_blocks(512)
    _as_gpu(monkeypatch, r, {"total_bytes": total, "in_use_bytes": in_use - 1, "weights_bytes": 0,
                             "activation_peak_bytes": 0})
    counts = r.plan_blocks(512)
    assert counts[None] >= sequence_blocks(None, 512, r.block_size)


def test_measure_memory_takes_the_peak_of_the_profile_run_above_the_weights(gemma_runner, monkeypatch):
    """Fake allocator counters: the peak is read after the profile run, relative to what was allocated
    before it, under statistics reset before it; in-use memory is read once the run's memory went back."""
    r = gemma_runner
    events = []
    state = {"allocated": 700, "peak": 700}

    def profile(max_len):
        events.append(("profile", max_len))
        state["peak"] = 700 + 250  # the forward's activations

    def reset(dev):
        events.append("reset")
        state["peak"] = state["allocated"]

    fake = dict(empty_cache=lambda: events.append("empty"), memory_allocated=lambda dev: state["allocated"],
                reset_peak_memory_stats=reset, synchronize=lambda dev: events.append("sync"),
                max_memory_allocated=lambda dev: state["peak"],
                mem_get_info=lambda dev: events.append("info") or (4000, 10000))
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(r, "profile_run", profile)
    m = r.measure_memory(64)
    assert m == {"total_bytes": 10000, "in_use_bytes": 6000, "weights_bytes": 700, "activation_peak_bytes": 250}
    assert events == ["empty", "reset", ("profile", 64), "sync", "empty", "info"]


# ---- the profile run, for real on the CPU -----------------------------------------------------------------
def _watch_forward(monkeypatch, runner) -> list:
    """Records (tokens, seq_lens, positions) of every eager forward of runner.model."""
    from compiled_llm.ops.attention import get_forward_context

    seen, inner = [], runner.model.forward

    def forward(input_ids, positions, *a, **kw):
        seen.append((input_ids.shape[0], list(get_forward_context().attn_metadata.seq_lens), positions.clone(), kw))
        return inner(input_ids, positions, *a, **kw)

    monkeypatch.setattr(runner.model, "forward", forward)
    return seen


def _watch_temporaries(monkeypatch, runner) -> list:
    """Weak references to every tensor the runner's cache factories make."""
    refs = []
    for name in ("_kv_tensors", "_state_tensors"):
        make = getattr(runner, name)

        def wrapped(*a, _make=make, **kw):
            out = _make(*a, **kw)
            for v in out.values():
                refs.extend(weakref.ref(t) for t in (v.values() if isinstance(v, dict) else [v]))
            return out

        monkeypatch.setattr(runner, name, wrapped)
    return refs


def _served_state(runner) -> list[torch.Tensor]:
    tensors = list(runner.kv_caches.values())
    tensors += [t for slot in runner.state_caches.values() for t in slot.values()]
    return [t.clone() for t in tensors]


def test_profile_run_is_one_eager_full_step_at_the_longest_context(gemma_runner, monkeypatch):
    r = gemma_runner
    assert r.compiler is not None  # compiling is on for this runner, and the profile must not use it
    monkeypatch.setattr(r.compiler, "compiled", lambda *a, **k: pytest.fail("the profile run compiled the model"))
    seen = _watch_forward(monkeypatch, r)
    r.profile_run(64)
    assert len(seen) == 1
    tokens, seq_lens, positions, _ = seen[0]
    assert tokens == 24 and seq_lens == [63]  # max_num_batched_tokens new tokens ending a 63-token prompt
    assert positions.tolist() == list(range(39, 63))
    seen.clear()
    r.profile_run(10)  # a step longer than a prompt: several prompts of max_model_len - 1 tokens
    tokens, seq_lens, positions, _ = seen[0]
    assert tokens == 27 and seq_lens == [9, 9, 9] and positions.tolist() == list(range(9)) * 3


@pytest.mark.parametrize("kind", ["gemma", "qwen"])
def test_profile_run_leaves_nothing_behind(kind, tiny_ckpt, tmp_path_factory, monkeypatch):
    """After serving, the profile run reads and writes none of the served KV cache or recurrent state, keeps
    no reference to its own temporaries, and greedy output is the same as before it."""
    if kind == "gemma":
        folder, _ = tiny_ckpt("all")
    else:
        folder = tmp_path_factory.mktemp("qwen_dense")
        make_qwen_checkpoint(folder, "dense")  # recurrent (linear-attention) layers: state slots
    llm = LLM(str(folder), enforce_eager=True, block_size=4, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=24, num_kv_blocks=64)
    runner = getattr(llm.engine, "executor", llm.engine).runner  # the engine's runner, with or without an executor
    prompt = {"prompt_token_ids": list(range(3, 33))}
    before = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    served = _served_state(runner)
    refs = _watch_temporaries(monkeypatch, runner)
    runner.profile_run(64)
    assert refs and (kind == "gemma" or len(refs) > len(runner.kv_caches))  # state slots were made too
    gc.collect()
    assert all(ref() is None for ref in refs)  # the temporary cache and state slots are gone
    assert all(torch.equal(a, b) for a, b in zip(served, _served_state(runner)))
    assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == before


def test_profile_run_on_pipeline_stages(tiny_ckpt, monkeypatch):
    """A later stage starts from zero tensors of the schema it would receive and computes logits; the first
    stage ends at its hand-over (no logits)."""
    folder, _ = tiny_ckpt("dense")
    shapes = []
    try:
        for rank in (0, 1):
            set_parallel_state(ParallelState(pp_size=2, pp_rank=rank))
            r = ModelRunner(EngineConfig(model=str(folder), enforce_eager=True, block_size=4,
                                         max_num_batched_tokens=16))
            seen = _watch_forward(monkeypatch, r)
            logits = []
            monkeypatch.setattr(r.model, "compute_logits", lambda h, _l=logits: _l.append(h.shape) or h)
            r.profile_run(32)
            shapes.append((sorted(seen[0][3].get("intermediate", {})), logits))
    finally:
        set_parallel_state(ParallelState())
    assert shapes[0] == ([], [])
    assert shapes[1][0] == ["hidden_states"] and shapes[1][1] == [torch.Size([16, 64])]


def test_gpu_plan_reserves_the_omnikv_decode_workspace(tiny_ckpt, monkeypatch):
    """OmniKV's filter layer keeps [rows, heads, width] float32 scores in a decode step (inside the captured
    decode graph for good), which the profiled prefill step does not show: the plan takes the larger of the
    two from the KV budget, so a long max_model_len with many sequences does not run out at capture."""
    folder, _ = tiny_ckpt("all")
    r = ModelRunner(EngineConfig(model=str(folder), block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
                                 sparse_method="omnikv", omnikv_budget=16, omnikv_recent=4))
    heads = max(r.specs[i].num_heads for i, role in r.sparse.roles.items() if role == "filter")
    ws = r.sparse.decode_workspace_bytes(4, 64)
    assert ws == 4 * 64 * 4 * (heads + 4) > 0
    total, in_use = 1000 * 2**20 + GPU_MARGIN_BYTES, 300 * 2**20
    for peak in (0, 10 * ws):  # the workspace counts where it is the larger, the profiled peak where that is
        _as_gpu(monkeypatch, r, {"total_bytes": total, "in_use_bytes": in_use, "weights_bytes": 200 * 2**20,
                                 "activation_peak_bytes": peak})
        r.plan_blocks(64)
        assert r.memory_profile["decode_workspace_bytes"] == ws
        assert r.memory_profile["kv_cache_bytes"] == int(total * 0.9) - (in_use + max(peak, ws) + GPU_MARGIN_BYTES)


def test_gpu_plan_reserves_the_prompt_graphs_pool(gemma_runner, monkeypatch):
    """CUDA-graph sizes above max_num_seqs (prompts) keep one forward's activations at the largest in the
    graph pool: the plan takes the activation peak scaled to that size's tokens off the KV cache (the decode
    sizes' few tokens stay in the margin), and records it."""
    from types import SimpleNamespace

    from compiled_llm.runtime.memory import prompt_graph_bytes

    assert prompt_graph_bytes(240, [1, 2, 4], 4, 24) == 0  # decode sizes only
    assert prompt_graph_bytes(240, [1, 2, 4, 8, 16], 4, 24) == 160
    assert prompt_graph_bytes(240, [1, 64], 4, 24) == 240  # never more than a full step's peak
    r = gemma_runner  # max_num_seqs 4, max_num_batched_tokens 24
    peak = 96 * 2**20
    measured = {"total_bytes": 1000 * 2**20 + GPU_MARGIN_BYTES, "in_use_bytes": 300 * 2**20,
                "weights_bytes": 200 * 2**20, "activation_peak_bytes": peak}
    budgets = {}
    for sizes in ([1, 2, 4], [1, 2, 4, 16]):
        _as_gpu(monkeypatch, r, measured)
        monkeypatch.setattr(r, "compiler", SimpleNamespace(compiled=SimpleNamespace(
            sizes=sizes, state=SimpleNamespace(cudagraphs=True))))
        r.plan_blocks(64)
        budgets[len(sizes)] = r.memory_profile["kv_cache_bytes"]
        assert r.memory_profile["prompt_graph_bytes"] == (peak * 16 // 24 if 16 in sizes else 0)
    assert budgets[3] - budgets[4] == peak * 16 // 24
