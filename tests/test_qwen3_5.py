"""Qwen3.5 (hybrid Gated DeltaNet + gated attention, dense and MoE) against transformers on tiny random
checkpoints: prefill logits, greedy tokens (batched, chunked prefill, preemption, abort), state slots,
and the reference ops (delta rule, conv1d with state, M-RoPE) against transformers' own functions."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_llm import LLM, SamplingParams
from compiled_llm.models.registry import resolve_model_class
from compiled_llm.ops.context import set_forward_context
from compiled_llm.runtime.scheduler import ScheduledSeq
from compiled_llm.runtime.sequence import Sequence
from qwen3_5_tiny import CONFIGS, FULL, LIN
from tiny_models import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
_REFS: dict = {}


def prompts(vocab: int, lengths=(5, 17, 30), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_ref(qwen_ckpt):
    def get(name):
        if name not in _REFS:
            _, hf = qwen_ckpt(name)
            ps = prompts(hf.config.get_text_config().vocab_size)
            _REFS[name] = (ps, [hf_greedy(hf, p, 32) for p in ps])
        return _REFS[name]

    return get


def make_llm(folder, **kw):
    kw.setdefault("enforce_eager", True)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 8)
    return LLM(str(folder), **kw)


def generate_ids(llm, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]


def free_slots(llm) -> int:
    return len(llm.engine.block_manager.free_state_slots)


# ---- the model against transformers ----------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_match(qwen_ckpt, name):
    folder, hf = qwen_ckpt(name)
    llm = make_llm(folder)
    runner, bm = llm.engine.executor.runner, llm.engine.block_manager
    ids = prompts(hf.config.get_text_config().vocab_size, (23,))[0]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    seq = Sequence("x", 0, ids, GREEDY, 1, 0.0)
    bm.allocate(seq, len(ids))
    batch = [ScheduledSeq(seq, len(ids))]
    input_ids, positions, meta, _, _ = runner.prepare(batch)
    with torch.no_grad(), set_forward_context(runner.forward_context(batch, meta)):
        ours = runner.model.compute_logits(runner.model(input_ids, positions))
    bm.free(seq)
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"{name}: max abs diff {err}"


@pytest.mark.parametrize("name", ["dense", "moe", pytest.param("dense_vl", marks=pytest.mark.slow),
                                  pytest.param("moe_vl", marks=pytest.mark.slow)])
def test_greedy_matches_transformers_batched(qwen_ckpt, hf_ref, name):
    folder, _ = qwen_ckpt(name)
    ps, ref = hf_ref(name)
    llm = make_llm(folder)
    assert generate_ids(llm, ps) == ref
    assert free_slots(llm) == 8  # every slot came back


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_chunked_prefill(qwen_ckpt, hf_ref, name):
    folder, _ = qwen_ckpt(name)
    ps, ref = hf_ref(name)
    llm = make_llm(folder, max_num_batched_tokens=7)  # prompts prefilled in chunks of <= 7 tokens, state carried
    assert generate_ids(llm, ps) == ref


@pytest.mark.slow
def test_greedy_chunked_one_at_a_time(qwen_ckpt, hf_ref):
    folder, _ = qwen_ckpt("moe")
    ps, ref = hf_ref("moe")
    llm = make_llm(folder, max_num_batched_tokens=7)
    assert [generate_ids(llm, [p])[0] for p in ps] == ref


@pytest.mark.parametrize("name,budget", [("dense", 7), ("moe", 2048)])
def test_greedy_under_preemption(qwen_ckpt, hf_ref, name, budget):
    """A preempted sequence gives its state slot back and is recomputed from a zero state."""
    folder, _ = qwen_ckpt(name)
    ps, ref = hf_ref(name)
    # 80 tokens of cache: the batch cannot fit at once (dense: with chunked prefill too)
    llm = make_llm(folder, num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=budget)
    assert generate_ids(llm, ps) == ref
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert free_slots(llm) == 8


def test_abort_frees_the_slot_and_others_continue(qwen_ckpt, hf_ref):
    folder, _ = qwen_ckpt("dense")
    ps, ref = hf_ref("dense")
    llm = make_llm(folder, max_num_batched_tokens=7)
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, GREEDY)
    for _ in range(5):  # r2 is mid-prefill, r0 decoding
        eng.step()
    eng.abort_request("r1")
    eng.add_request("again", ps[1], GREEDY)  # may take the slot r1 left
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done["r0"], done["again"], done["r2"]] == ref
    assert free_slots(llm) == 8


def test_prefix_caching_is_off_without_state_snapshots(qwen_ckpt):
    """Prefix hits of a hybrid model need recurrent-state snapshots (tests/test_qwen3_5_prefix_cache.py);
    --prefix-state-snapshots 0 turns them, and so prefix caching, off."""
    folder, hf = qwen_ckpt("dense")
    llm = make_llm(folder, enable_prefix_caching=True, prefix_state_snapshots=0)
    assert llm.engine.config.enable_prefix_caching is False
    assert llm.engine.executor.num_state_slots == 8
    ps = prompts(hf.config.vocab_size, (30,))
    few = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert generate_ids(llm, ps, few) == generate_ids(llm, ps, few)
    assert llm.engine.get_stats()["prefix_cache_hits"] == 0


def test_state_slots_come_out_of_the_cache_budget(qwen_ckpt):
    folder, _ = qwen_ckpt("dense")
    with pytest.raises(ValueError, match="recurrent state of 8 sequences"):
        make_llm(folder, kv_cache_memory_bytes=10_000)
    small, big = make_llm(folder, kv_cache_memory_bytes=1 << 20), make_llm(folder, kv_cache_memory_bytes=2 << 20)
    assert small.engine.executor.runner.state_bytes() > 0
    assert big.engine.get_stats()["num_total_blocks"] > small.engine.get_stats()["num_total_blocks"]


def test_per_expert_and_packed_checkpoints_load_alike(qwen_ckpt, tmp_path):
    import shutil

    folder, _ = qwen_ckpt("moe")
    w = load_file(str(folder / "model.safetensors"))
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in w)  # transformers saves per-expert tensors
    packed, moved = {}, {}
    for k, t in w.items():
        if ".mlp.experts." in k:
            base, e, proj = k.rsplit(".", 3)[0], int(k.split(".experts.")[1].split(".")[0]), k.split(".")[-2]
            moved.setdefault((base, proj), {})[e] = t
        else:
            packed[k] = t
    for (base, proj), per in moved.items():
        stacked = torch.stack([per[e] for e in sorted(per)])
        if proj == "down_proj":
            packed[f"{base}.down_proj"] = stacked
        elif proj == "gate_proj":
            ups = torch.stack([moved[(base, "up_proj")][e] for e in sorted(per)])
            packed[f"{base}.gate_up_proj"] = torch.cat([stacked, ups], dim=1)
    dst = tmp_path / "packed"
    shutil.copytree(folder, dst)
    save_file(packed, str(dst / "model.safetensors"))
    a, b = make_llm(folder).engine.executor.runner.model, make_llm(dst).engine.executor.runner.model
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na


def test_registry_declares_capabilities():
    from compiled_llm.models.interfaces import (has_recurrent_state, supports_ep, supports_multimodal, supports_pp,
                                                supports_tp, uses_mrope)

    for arch in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForConditionalGeneration"):
        cls = resolve_model_class({"architectures": [arch]})
        assert uses_mrope(cls) is True and supports_multimodal(cls) == arch.endswith("ConditionalGeneration")
        assert supports_pp(cls) is False and has_recurrent_state(cls)
        assert supports_tp(cls) and supports_ep(cls)  # tests/test_qwen3_5_parallel.py


# ---- reference ops against transformers' functions ------------------------------------------

def _delta_inputs(b, t, hk, hv, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, hk, dk, generator=g), torch.randn(b, t, hk, dk, generator=g)
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = -torch.rand(b, t, hv, generator=g) * 2
    beta = torch.rand(b, t, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g) * 0.5
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("t,chunk", [(1, 64), (7, 4), (37, 16), (70, 64)])
def test_delta_rule_matches_transformers(t, chunk):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from compiled_llm.ops.delta_rule import chunk_delta_rule, prepare_qk, recurrent_delta_rule

    q, k, v, decay, beta, state = _delta_inputs(2, t, 2, 4, 8, 6)
    ref, ref_state = m.torch_recurrent_gated_delta_rule(q, k, v, decay, beta, initial_state=state.clone(),
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    qp, kp = prepare_qk(q, k, 4)
    for fn in (recurrent_delta_rule, lambda *a: chunk_delta_rule(*a, chunk_size=chunk)):
        o, s = fn(qp, kp, v, decay, beta, state.clone())
        assert torch.allclose(o, ref, atol=1e-5), (o - ref).abs().max()
        assert torch.allclose(s, ref_state, atol=1e-5), (s - ref_state).abs().max()


def test_state_ops_split_anywhere_equal_one_pass():
    """A sequence fed in pieces (prefill chunks, single decode tokens, batched with others) gives the
    same outputs and final state as in one piece."""
    from compiled_llm.ops.conv1d import causal_conv1d_ref, causal_conv1d_with_state
    from compiled_llm.ops.delta_rule import gated_delta_rule_with_state
    from compiled_llm.ops.state import StateLayout

    g = torch.Generator().manual_seed(0)
    lens = [9, 1, 13]
    n = sum(lens)
    x = torch.randn(n, 12, generator=g)
    w = torch.randn(12, 4, generator=g)
    q, k = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    v = torch.randn(n, 4, 6, generator=g)
    decay, beta = -torch.rand(n, 4, generator=g), torch.rand(n, 4, generator=g)
    starts = [0, 9, 10]
    # one pass per sequence
    full_x, full_o, conv_states, ssm_states = [], [], [], []
    for s, ln in zip(starts, lens):
        conv = torch.zeros(1, 12, 3)
        ssm = torch.zeros(1, 4, 8, 6)
        sl = slice(s, s + ln)
        one = StateLayout.build([0], [False], [0, ln], "cpu")
        full_x.append(causal_conv1d_with_state(x[sl], w, conv, one))
        full_o.append(gated_delta_rule_with_state(q[sl], k[sl], v[sl], decay[sl], beta[sl], ssm, one))
        conv_states.append(conv[0])
        ssm_states.append(ssm[0])
    # pieces: steps that take [4, 1, 6], then [5, 0, 7] tokens of the three sequences (slots 2, 0, 1)
    conv = torch.full((3, 12, 3), float("nan"))  # stale slots must not leak in
    ssm = torch.full((3, 4, 8, 6), float("nan"))
    slots = [2, 0, 1]
    got_x = [[] for _ in lens]
    got_o = [[] for _ in lens]
    done = [0, 0, 0]
    for step in ([4, 1, 6], [5, 0, 7]):
        idx, qsl, keep, sl_ids = [], [0], [], []
        for i, m in enumerate(step):
            if m == 0:
                continue
            idx.extend(range(starts[i] + done[i], starts[i] + done[i] + m))
            qsl.append(qsl[-1] + m)
            keep.append(done[i] > 0)
            sl_ids.append(i)
        rows = torch.tensor(idx)
        layout = StateLayout.build([slots[i] for i in sl_ids], keep, qsl, "cpu")
        ox = causal_conv1d_with_state(x[rows], w, conv, layout)
        oo = gated_delta_rule_with_state(q[rows], k[rows], v[rows], decay[rows], beta[rows], ssm, layout)
        for j, i in enumerate(sl_ids):
            got_x[i].append(ox[qsl[j]:qsl[j + 1]])
            got_o[i].append(oo[qsl[j]:qsl[j + 1]])
            done[i] += step[i]
    for i in range(3):
        assert torch.allclose(torch.cat(got_x[i]), full_x[i], atol=1e-5)
        assert torch.allclose(torch.cat(got_o[i]), full_o[i], atol=1e-5)
        assert torch.allclose(conv[slots[i]], conv_states[i], atol=1e-6)
        assert torch.allclose(ssm[slots[i]], ssm_states[i], atol=1e-5)
    # and the one-pass conv equals transformers' causal_conv1d_fn
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    ref = m.causal_conv1d_fn(x[None, :9].transpose(1, 2), w, None, activation="silu")[0].t()
    assert torch.allclose(causal_conv1d_ref(x[:9], w, None)[0], ref, atol=1e-6)


def test_mrope_matches_transformers():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

    from compiled_llm.ops.mrope import apply_mrope, mrope_cos_sin, mrope_owner, rotary_inv_freq

    cfg = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=2, head_dim=32, rope_parameters=dict(
        rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.75, mrope_section=[5, 4, 3],
        mrope_interleaved=True))
    rope = Qwen3_5TextRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 50, (3, 11), generator=g)
    x = torch.randn(1, 11, 64)
    ref_cos, ref_sin = rope(x, pos[:, None, :])
    inv = rotary_inv_freq(32, 1000.0, 0.75)
    owner = mrope_owner(len(inv), [5, 4, 3], True)
    cos, sin = mrope_cos_sin(pos, inv, owner, torch.float32)
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)
    q, k = torch.randn(11, 2, 32, generator=g), torch.randn(11, 1, 32, generator=g)
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    oq, ok = apply_mrope(q, k, cos, sin)
    assert torch.allclose(oq, rq[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(ok, rk[0].transpose(0, 1), atol=1e-6)
    # text-only positions: [tokens] equals three equal rows
    c1, _ = mrope_cos_sin(pos[0], inv, owner, torch.float32)
    c3, _ = mrope_cos_sin(pos[0].expand(3, -1), inv, owner, torch.float32)
    assert torch.equal(c1, c3)


# ---- vision: M-RoPE positions, the reused tower, an image prompt end to end (model level) --------

def _vision_prompt(hf):
    """text, <vs> image(1x4x6 patches) <ve>, text, <vs> frame <ve> ts <vs> frame <ve> (a 2x4x4 video), text."""
    from compiled_llm.models.qwen3_5_vision import IMAGE, TEXT, VIDEO

    c = hf.config
    vs, ve, img, vid = c.vision_start_token_id, c.vision_end_token_id, c.image_token_id, c.video_token_id
    ids, types = [5, 6, 7, vs], [TEXT] * 4
    ids += [img] * 6 + [ve, 8, 9, vs]
    types += [IMAGE] * 6 + [TEXT] * 4
    ids += [vid] * 4 + [ve, 10, vs] + [vid] * 4 + [ve, 11, 12]
    types += [VIDEO] * 4 + [TEXT] * 3 + [VIDEO] * 4 + [TEXT] * 3
    return ids, types, [(1, 4, 6)], [(2, 4, 4)]


def test_mrope_positions_match_transformers(qwen_ckpt):
    from compiled_llm.models.qwen3_5_vision import mrope_positions

    _, hf = qwen_ckpt("dense_vl")
    ids, types, images, videos = _vision_prompt(hf)
    ref, delta = hf.model.get_rope_index(torch.tensor([ids]), torch.tensor([types]),
                                         image_grid_thw=torch.tensor(images), video_grid_thw=torch.tensor(videos))
    ours, our_delta = mrope_positions(types, images, videos, spatial_merge_size=2)
    assert torch.equal(ours, ref[:, 0]) and our_delta == int(delta)


def test_image_prompt_matches_transformers(qwen_ckpt):
    """Prefill logits and the next greedy tokens of an image prompt: transformers' vision tower, our merge,
    M-RoPE positions and text model (decode positions continue at index + delta)."""
    import json

    from compiled_llm.models.qwen3_5_vision import VisionTower, merge_embeddings, mrope_positions

    folder, hf = qwen_ckpt("dense_vl")
    c = hf.config
    ids = [5, 6, 7, c.vision_start_token_id] + [c.image_token_id] * 6 + [c.vision_end_token_id, 8, 9]
    types = [0] * 4 + [1] * 6 + [0] * 3
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(0))
    kw = dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=torch.tensor([types]))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), **kw).logits[0]
    hf.generation_config.eos_token_id = None
    ref_next = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                           **kw)[0, len(ids):].tolist()

    tower = VisionTower(json.loads((folder / "config.json").read_text())["vision_config"]).load(folder)
    llm = make_llm(folder)
    runner, bm = llm.engine.executor.runner, llm.engine.block_manager
    model = runner.model
    feats = tower(pixels, grid)
    embeds = merge_embeddings(model.model.embed_tokens(torch.tensor(ids)), torch.tensor(types), feats)
    positions, delta = mrope_positions(types, [(1, 4, 6)], [], tower.spatial_merge_size)
    seq = Sequence("x", 0, ids, GREEDY, 8, 0.0)
    bm.allocate(seq, len(ids))
    batch = [ScheduledSeq(seq, len(ids))]
    _, _, meta, _, _ = runner.prepare(batch)
    with torch.no_grad(), set_forward_context(runner.forward_context(batch, meta)):
        ours = model.compute_logits(model(None, positions, embeds))
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"max abs diff {err}"
    got = []
    seq.num_computed_tokens = len(ids)
    tok = int(ours[-1].argmax())
    for _ in range(6):  # greedy decode: text positions continue at index + delta
        got.append(tok)
        seq.token_ids.append(tok)
        bm.allocate(seq, 1)
        batch = [ScheduledSeq(seq, 1)]
        input_ids, pos, meta, _, _ = runner.prepare(batch)
        with torch.no_grad(), set_forward_context(runner.forward_context(batch, meta)):
            logits = model.compute_logits(model(input_ids, (pos + delta).expand(3, -1)))
        seq.num_computed_tokens += 1
        tok = int(logits[-1].argmax())
    bm.free(seq)
    assert got == ref_next


# ---- compiled path -----------------------------------------------------------------------------

def test_compiled_prompt_bucket_carries_state(qwen_ckpt, hf_ref):
    """A bucket above max_num_seqs is a prompt's (a prefill CUDA graph on the GPU): 16-token prefill chunks run
    padded in it, the recurrent-state ops eager between its pieces on the real rows; tokens equal
    transformers'."""
    folder, _ = qwen_ckpt("dense")
    ps, ref = hf_ref("dense")
    llm = make_llm(folder, enforce_eager=False, max_num_seqs=2, max_num_batched_tokens=16,
                   cudagraph_batch_sizes="1,2,16", jit_monitor="error")
    assert "prefill size 16" in llm.engine.executor.runner.compiler.warmup_seconds
    assert generate_ids(llm, ps) == ref


@pytest.mark.parametrize("name,split", [("dense", "off"), pytest.param("moe", "on", marks=pytest.mark.slow)])
def test_compiled_greedy_matches_transformers(qwen_ckpt, hf_ref, name, split):
    """The compiler splits the graph at the recurrent-state ops as at attention: compiled pieces between
    them, the state ops eager. Or, as a CPU engine does by default (split off), one graph that calls them: the
    M-RoPE table then serves both full-attention layers' fusion matches, each paired within its layer. Greedy
    tokens equal transformers', with chunked prefill carrying state."""
    folder, _ = qwen_ckpt(name)
    ps, ref = hf_ref(name)
    # compile_sizes none: the batch buckets replay the dynamic compile (static compiles: the Gemma 4 tests)
    llm = make_llm(folder, enforce_eager=False, max_num_batched_tokens=7, cudagraph_batch_sizes="1,4",
                   compile_sizes="none", jit_monitor="error", fusion_check="error",  # every layer: its fusions
                   split_graph=split)
    summary = llm.engine.executor.runner.compiler.summary()
    types = CONFIGS[name][1]["layer_types"]
    moe = len(types) if name == "moe" else 0
    # skinny_mm: the projections on oneDNN's packed weights (ops/linear.py), 4 a layer (in/out or qkv/o, the MLP's
    # gate_up and down; the MoE's shared expert adds its gate)
    assert {n: p["matches"] for n, p in summary["passes"].items()} == {
        "add_rms_norm": 2 * len(types), "qk_norm_rope_kv_write": types.count(FULL), "router_topk": moe,
        "swiglu_moe": moe, "geglu_moe": 0, "skinny_mm": (5 if moe else 4) * len(types)}
    # split, every layer splits once: the delta-rule op (its conv inside) or attention
    assert summary["attention_ops"] == (types.count(LIN) + types.count(FULL) if split == "on" else 0)
    assert summary["pieces"] == summary["attention_ops"] + 1
    assert generate_ids(llm, ps) == ref
    assert free_slots(llm) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_moe_gets_every_fusion_in_both_dtypes(qwen_ckpt, dtype):
    """The tiny MoE checkpoint's graph on the CPU (the graph audit: fake tensors, our passes, no kernels): per
    layer two RMSNorm + residual adds, the router and the SwiGLU MoE, and QK-norm + M-RoPE + KV write on the
    full-attention layer. bfloat16 graphs carry casts float32 ones do not. (One-token graphs: tests/passes.)"""
    import json

    from compiled_llm.runtime.audit import audit

    cfg = json.loads((qwen_ckpt("moe")[0] / "config.json").read_text())
    r = audit(cfg, device="cpu", dtype=dtype, tokens=32)
    assert r.mismatches == []
    types = CONFIGS["moe"][1]["layer_types"]
    got = r.layer_matches()
    assert {i: dict(got[i]) for i in range(len(types))} == {
        i: {"add_rms_norm": 2, "router_topk": 1, "swiglu_moe": 1, **({"qk_norm_rope_kv_write": 1} if t == FULL else {}),
            "skinny_mm": 5}  # the CPU's projections on oneDNN (ops/linear.py): 2 of attention, 3 of the shared expert
        for i, t in enumerate(types)}
