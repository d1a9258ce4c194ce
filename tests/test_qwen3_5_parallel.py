"""Tensor and expert parallelism for Qwen3.5 (dense and MoE) on the CPU: 2 processes talking through gloo.

Each parallel engine must give the same greedy tokens as one process (which equals transformers,
tests/test_qwen3_5.py) and hold only its share: half of the attention and linear-attention heads, so
half of the KV cache and of the conv / delta-rule state per sequence. The rank slices are also checked
without processes: put back together they give the checkpoint's tensors, the [q; k; v] blocks of the
linear-attention projection included.
"""

from __future__ import annotations

import pytest
import torch

from test_parallel import generate_ids, make_llm, rank_shards  # the Gemma parallel tests' engine settings, runs

_REFS: dict = {}


def reference(qwen_ckpt, name):
    """(prompts, one-process greedy tokens, attention specs, state shapes) of a tiny checkpoint."""
    if name not in _REFS:
        llm = make_llm(qwen_ckpt(name)[0], max_num_seqs=4)
        runner = llm.engine.executor.runner
        g = torch.Generator().manual_seed(3)
        ps = [torch.randint(3, runner.model_config.vocab_size, (n,), generator=g).tolist() for n in (5, 19, 33)]
        _REFS[name] = (ps, generate_ids(llm, ps), runner.specs, state_shapes(runner))
    return _REFS[name]


def state_shapes(runner) -> dict[int, dict[str, tuple]]:
    """The allocated recurrent state of one sequence, per layer and state name."""
    return {i: {k: tuple(t.shape[1:]) for k, t in s.items()} for i, s in runner.state_caches.items()}


@pytest.fixture
def parallel_llm(qwen_ckpt):
    """parallel_llm(name, **engine kwargs) -> LLM; shut down after the test."""
    made = []

    def start(name, **kw):
        llm = make_llm(qwen_ckpt(name)[0], **{"max_num_seqs": 4, **kw})
        made.append(llm)
        return llm

    yield start
    for llm in made:
        llm.engine.shutdown()


def check_halved(runner, ref_specs, ref_states) -> None:
    """This rank's KV heads and recurrent state are half of the one-process ones (2 KV heads -> 1; 4 query
    heads -> 2; conv channels and value heads of the delta-rule state halved)."""
    for i, s in runner.specs.items():
        assert (s.num_heads, s.num_kv_heads) == (ref_specs[i].num_heads // 2, ref_specs[i].num_kv_heads // 2)
    states = state_shapes(runner)
    assert set(states) == set(ref_states) and states
    for i, shapes in ref_states.items():
        channels, window = shapes["conv"]
        heads, dk, dv = shapes["ssm"]
        assert states[i] == {"conv": (channels // 2, window), "ssm": (heads // 2, dk, dv)}


# ---- no processes: what each rank loads --------------------------------------------------------------
def test_rank_slices_reassemble_checkpoint(qwen_ckpt):
    """Built as rank 0 and rank 1 of TP2, the slices put back together give the checkpoint's tensors: the
    [q; k; v] blocks of in_proj_qkv and the conv channels per block, z, b and a after them in the merged input
    projection, per-head vectors, the gated q_proj by whole [query; gate] heads, per-expert gate and up
    projections into the packed experts."""
    from safetensors import safe_open

    from compiled_llm.models.qwen3_5 import Qwen3_5MoeForCausalLM

    folder, _ = qwen_ckpt("moe")
    cfg, shards = rank_shards(Qwen3_5MoeForCausalLM, folder)

    def joined(name, dim=0):
        return torch.cat([s[name] for s in shards], dim)

    lin, full = "model.layers.0.linear_attn.", "model.layers.2.self_attn."
    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        # the merged [q; k; v; z; b; a] input projection: each rank holds [q_r; k_r; v_r; z_r; b_r; a_r], the
        # checkpoint's in_proj_qkv (whose [q; k; v] the conv channels follow), in_proj_z, in_proj_b, in_proj_a
        vh = cfg.linear_num_value_heads
        merged = [s[lin + "in_proj.weight"] for s in shards]
        assert all(p.shape[0] == (2 * kd + 2 * vd + 2 * vh) // 2 for p in merged)
        conv = [s[lin + "conv1d.weight"] for s in shards]
        for name, parts in (("in_proj_qkv.weight", merged), ("conv1d.weight", conv)):
            w = f.get_tensor(lin + name)
            for a, b, n in ((0, 0, kd), (kd, kd // 2, kd), (2 * kd, kd, vd)):
                assert torch.equal(torch.cat([p[b:b + n // 2] for p in parts]), w[a:a + n]), (name, a)
        at = kd + vd // 2  # this rank's rows of the merged projection after [q_r; k_r; v_r]
        for name, n in (("in_proj_z.weight", vd), ("in_proj_b.weight", vh), ("in_proj_a.weight", vh)):
            assert torch.equal(torch.cat([p[at:at + n // 2] for p in merged]), f.get_tensor(lin + name)), name
            at += n // 2
        for name in ("dt_bias", "A_log"):
            assert torch.equal(joined(lin + name), f.get_tensor(lin + name)), name
        assert torch.equal(joined(lin + "out_proj.weight", 1), f.get_tensor(lin + "out_proj.weight"))
        # the merged [q; k; v]: each rank holds [q_r; k_r; v_r], q by whole [query; gate] heads, KV heads halved
        # (or replicated: one KV head)
        nq, d, kvh = cfg.num_attention_heads * 2 * cfg.head_dim, cfg.head_dim, cfg.num_key_value_heads
        rq, rkv = nq // 2, (kvh // 2 if kvh >= 2 else kvh) * d
        qkv = [s[full + "qkv_proj.weight"] for s in shards]
        assert all(p.shape[0] == rq + 2 * rkv for p in qkv)
        assert torch.equal(torch.cat([p[:rq] for p in qkv]), f.get_tensor(full + "q_proj.weight"))
        for j, name in ((1, "k_proj.weight"), (2, "v_proj.weight")):
            rows = [p[rq + (j - 1) * rkv: rq + j * rkv] for p in qkv]
            want = f.get_tensor(full + name)
            assert torch.equal(torch.cat(rows), want) if kvh >= 2 else all(torch.equal(r, want) for r in rows)
        assert torch.equal(joined(full + "o_proj.weight", 1), f.get_tensor(full + "o_proj.weight"))
        i = cfg.moe_intermediate_size
        gate_up = [s["model.layers.0.mlp.experts.gate_up_proj"] for s in shards]  # [E, 2 * I/2, H] per rank
        assert torch.equal(torch.cat([p[3, :i // 2] for p in gate_up]),
                           f.get_tensor("model.layers.0.mlp.experts.3.gate_proj.weight"))
        assert torch.equal(torch.cat([p[3, i // 2:] for p in gate_up]),
                           f.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight"))
        assert torch.equal(joined("model.layers.0.mlp.experts.down_proj", 2)[3],
                           f.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight"))
        for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight"):
            assert all(torch.equal(s[name], f.get_tensor(name)) for s in shards)  # replicated


# ---- two processes -------------------------------------------------------------------------------
def test_tp2_dense_greedy_and_halved_state(qwen_ckpt, parallel_llm):
    ps, ref, specs, states = reference(qwen_ckpt, "dense")
    llm = parallel_llm("dense", tensor_parallel_size=2)
    assert generate_ids(llm, ps) == ref
    check_halved(llm.engine.executor.runner, specs, states)
    # again: prefix hits restore each rank's half of the recurrent state from its snapshot slots
    assert generate_ids(llm, ps) == ref
    stats = llm.engine.get_stats()
    assert (stats["prefix_state_snapshot_hits"], stats["prefix_cache_hits"]) == (3, 4 + 16 + 32)


def test_tp2_moe_greedy(qwen_ckpt, parallel_llm):
    ps, ref, specs, states = reference(qwen_ckpt, "moe")
    llm = parallel_llm("moe", tensor_parallel_size=2)
    assert generate_ids(llm, ps) == ref
    check_halved(llm.engine.executor.runner, specs, states)


@pytest.mark.parametrize("dispatch", [pytest.param("all_reduce", marks=pytest.mark.slow), "all_to_all"])
def test_tp2_expert_parallel_greedy(qwen_ckpt, parallel_llm, monkeypatch, dispatch):
    monkeypatch.setenv("COMPILED_LLM_MOE_DISPATCH", dispatch)  # the spawned worker inherits it
    ps, ref, _, _ = reference(qwen_ckpt, "moe")
    llm = parallel_llm("moe", tensor_parallel_size=2, enable_expert_parallel=True)
    experts = llm.engine.executor.runner.model.model.layers[0].mlp.experts
    assert (experts.num_local_experts, experts.first_expert, experts.local_intermediate) == (4, 0, 24)
    assert experts.use_all_to_all(1) == (dispatch == "all_to_all")
    assert generate_ids(llm, ps) == ref
