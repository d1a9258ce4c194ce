"""Sparse KV for long contexts: StreamingLLM and OmniKV (docs/sparse_kv.md).

Unit tests of the pieces (block release, the attention op's position handling, token selection,
parameter checks), then the engine on tiny Gemma 4 checkpoints: lossless settings equal dense, bounded
StreamingLLM caches, chunked prefill and prefix caching change nothing, a needle only OmniKV retrieves,
and greedy agreement / perplexity against dense (reported, see the test output with -s).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.config import EngineConfig
from compiled_llm.ops import sparse as sparse_ops
from compiled_llm.ops.attention import AttentionSpec, ref_attention
from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata, set_forward_context
from compiled_llm.ops.rope import apply_rope, rope_inv_freq
from compiled_llm.ops.sparse import SPARSE_KEY, SparseMetadata, omnikv_select
from compiled_llm.runtime.block_manager import BlockManager
from compiled_llm.runtime.sequence import Sequence
from compiled_llm.runtime.sparse_eval import agreement, greedy, perplexity, teacher_forced_logprobs
from compiled_llm.runtime.sparse_kv import SparseKV, SparseKVConfig


def _seq(tokens):
    return Sequence("r", 0, tokens, SamplingParams(), 8, 0.0)


def _prompts(n_tokens: list[int], seed: int = 0, vocab: int = 290) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_tokens]


# ---- block manager -----------------------------------------------------------------------------


def test_streaming_group_keeps_sinks_and_window_releases_the_middle():
    group = (8, 5)  # window 8, 5 sinks -> 2 sink blocks of 4
    bm = BlockManager({None: 128, 12: 64, group: 64}, block_size=4, enable_prefix_caching=True)
    seq = _seq(list(range(40)))
    bm.allocate(seq, 40)
    seq.num_computed_tokens = 40
    bm.commit(seq)
    table = seq.block_tables[group]
    # next query at 40 sees 0..4 (sinks) and 33..40: blocks 0, 1 and 8, 9
    assert [b >= 0 for b in table] == [True, True] + [False] * 6 + [True, True]
    assert bm.pools[group].num_used == 4 and bm.pools[12].num_used == 3 and bm.pools[None].num_used == 10
    # a long run keeps the count bounded
    for t in range(40, 400):
        seq.token_ids.append(7)
        bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.commit(seq)
        assert bm.pools[group].num_used <= 2 + 3


def test_streaming_prefix_plan_needs_sink_and_window_blocks():
    group = (8, 5)
    bm = BlockManager({group: 64}, block_size=4, enable_prefix_caching=True)
    a = _seq(list(range(40)))
    bm.allocate(a, 40)
    a.num_computed_tokens = 40
    bm.commit(a)
    bm.free(a)
    b = _seq(list(range(40)) + [99, 98])
    plan = bm.plan_prefix(b)
    assert plan.num_blocks == 10
    assert [x >= 0 for x in plan.tables[group]] == [True, True] + [False] * 6 + [True, True]
    # evict a sink block: no hit can be served any more (every prefix past the sinks needs them)
    pool = bm.pools[group]
    blk = pool.by_hash.pop(b.block_hashes[1])
    pool.hash_of[blk] = None
    assert bm.plan_prefix(_seq(list(range(40)) + [99])).num_blocks <= 1


# ---- the attention op ------------------------------------------------------------------------


def _context(spec, cache, tables, seq_lens, qsl, bs, sm=None, group=None):
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_size=bs,
                             groups={group if group is not None else spec.kv_group:
                                     GroupMetadata(tables, torch.zeros(0, dtype=torch.long))})
    return ForwardContext(meta, {spec.cache_layer: cache}, {spec.layer_idx: spec},
                          {SPARSE_KEY: sm} if sm is not None else {})


@pytest.mark.parametrize("vectorized", [True, False])
def test_streamingllm_positions_are_cache_positions(vectorized, monkeypatch):
    """The op's result equals StreamingLLM as defined: the kept tokens renumbered 0.. in cache order,
    keys and query rotated with those positions."""
    monkeypatch.setattr(sparse_ops, "VECTORIZED", vectorized)
    torch.manual_seed(0)
    h, kvh, d, bs, S, W, L = 4, 2, 16, 4, 3, 5, 23
    inv = rope_inv_freq(d, 100.0)
    spec = AttentionSpec(layer_idx=0, num_heads=h, num_kv_heads=kvh, head_dim=d, sliding_window=W, cache_layer=0,
                         scale=d ** -0.5, softcap=20.0, inv_freq=inv, sink_tokens=S)
    k_raw, v = torch.randn(L, kvh, d), torch.randn(L, kvh, d)
    q_raw = torch.randn(L, h, d)
    nblocks = -(-L // bs)
    perm = torch.randperm(nblocks) + 2
    cache = torch.zeros(2, nblocks + 2, bs, kvh, d)
    pos = torch.arange(L)
    flat = cache.view(2, -1, kvh, d)
    slots = perm[pos // bs] * bs + pos % bs
    flat[0][slots] = apply_rope(k_raw, pos, inv)
    flat[1][slots] = v

    def expected(p):
        kept = [t for t in range(p + 1) if t < S or t > p - W]
        cpos = torch.arange(len(kept))
        keys = apply_rope(k_raw[kept], cpos, inv).repeat_interleave(h // kvh, 1)
        qq = apply_rope(q_raw[p:p + 1], cpos[-1:], inv)
        s = torch.einsum("hd,mhd->hm", qq[0], keys) * spec.scale
        s = torch.tanh(s / 20.0) * 20.0
        return torch.einsum("hm,mhd->hd", torch.softmax(s, -1), v[kept].repeat_interleave(h // kvh, 1))

    # decode rows of two sequences sharing the cache (one long, one short enough to be dense)
    table = perm[None].clone()
    tables = torch.cat([table, table]).int()
    for released in (False, True):
        if released:  # the middle blocks are gone for the long sequence: never read
            tables[0, 1:(L - W) // bs] = -1
        q = torch.stack([apply_rope(q_raw[L - 1:L], pos[L - 1:L], inv)[0], apply_rope(q_raw[6:7], pos[6:7], inv)[0]])
        with set_forward_context(_context(spec, cache, tables, [L, 7], [0, 1, 2], bs)):
            out = ref_attention(q.reshape(2, -1), 0).view(2, h, d)
        torch.testing.assert_close(out[0], expected(L - 1), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out[1], expected(6), atol=1e-5, rtol=1e-4)
    # a prefill chunk: every query with its own window and shift
    q = apply_rope(q_raw[L - 9:], pos[L - 9:], inv)
    tables = perm[None].int().clone()
    with set_forward_context(_context(spec, cache, tables, [L], [0, 9], bs)):
        out = ref_attention(q.reshape(9, -1), 0).view(9, h, d)
    for r, p in enumerate(range(L - 9, L)):
        torch.testing.assert_close(out[r], expected(p), atol=1e-5, rtol=1e-4)


def test_omnikv_select_keeps_sinks_recent_and_best():
    score = torch.tensor([[0.0, 0.1, 0.9, 0.0, 0.5, 0.0, 0.2, 0.0, 0.0, 0.3]])
    pos = torch.arange(10)[None]
    valid = torch.ones(1, 10, dtype=torch.bool)
    chosen = omnikv_select(score, pos, valid, torch.tensor([10]), budget=5, sink=1, recent=2)
    assert chosen.tolist() == [[0, 2, 4, 8, 9]]
    # fewer valid positions than the budget: all of them, ascending, then -1
    valid[0, 4:] = False
    chosen = omnikv_select(score, pos, valid, torch.tensor([4]), budget=6, sink=1, recent=1)
    assert chosen.tolist() == [[0, 1, 2, 3, -1, -1]]


def test_omnikv_sparse_layer_attends_to_the_picked_tokens_only():
    """A filter layer picks from its scores; a sparse layer then reads exactly those positions (both paths)."""
    torch.manual_seed(1)
    h, kvh, d, bs, L = 2, 1, 8, 4, 30
    mk = lambda i, role: AttentionSpec(layer_idx=i, num_heads=h, num_kv_heads=kvh, head_dim=d, sliding_window=None,
                                       cache_layer=i, scale=1.0, omnikv=role)
    specs = {0: mk(0, "filter"), 1: mk(1, "sparse")}
    caches = {i: torch.randn(2, 8, bs, kvh, d) for i in specs}
    tables = torch.arange(8)[None].int()
    q = torch.randn(1, h * d)
    outs = {}
    for vec in (True, False):
        sparse_ops.VECTORIZED = vec
        try:
            sm = SparseMetadata(decode=[True], index=torch.full((1, 9), -1, dtype=torch.int32), budget=9, sink=2,
                                recent=3)
            meta = AttentionMetadata([0, 1], [L], bs, {None: GroupMetadata(tables, torch.zeros(0, dtype=torch.long))})
            with set_forward_context(ForwardContext(meta, caches, specs, {SPARSE_KEY: sm})):
                ref_attention(q, 0)
                outs[vec] = (ref_attention(q, 1), sm.index[0].tolist())
        finally:
            sparse_ops.VECTORIZED = True
    picked = outs[True][1]
    assert picked == outs[False][1] and len(picked) == 9 and picked == sorted(picked)
    assert {0, 1, 27, 28, 29} <= set(picked)
    torch.testing.assert_close(outs[True][0], outs[False][0])
    # the sparse layer's output is dense attention over the picked positions alone
    k, v = caches[1][0].reshape(-1, kvh, d)[picked], caches[1][1].reshape(-1, kvh, d)[picked]
    p = torch.softmax(torch.einsum("hd,mhd->hm", q.view(h, d), k.expand(-1, h, -1)), -1)
    torch.testing.assert_close(outs[True][0].view(h, d), torch.einsum("hm,mhd->hd", p, v.expand(-1, h, -1)))


# ---- parameter checks ------------------------------------------------------------------------


@pytest.mark.parametrize("kw, msg", [
    (dict(sparse_method="h2o"), "sparse_method must be one of"),
    (dict(sparse_method="streamingllm", sparse_window=0), "sparse_window must be >= 1"),
    (dict(sparse_method="streamingllm", sparse_sink_tokens=-1), "sparse_sink_tokens must be >= 0"),
    (dict(sparse_method="omnikv", omnikv_budget=10, omnikv_recent=6), "must exceed"),
    (dict(sparse_method="omnikv", omnikv_recent=0), "omnikv_recent must be >= 1"),
    (dict(sparse_method="omnikv", omnikv_filter_layers="1,x"), "comma-separated"),
    (dict(sparse_method="streamingllm", omnikv_filter_layers="1"), "not omnikv"),
])
def test_bad_parameters_are_refused_in_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        SparseKVConfig.from_engine_config(EngineConfig(**kw))
    assert "\n" not in str(e.value)


def test_filter_layer_must_be_a_full_attention_layer():
    mk = lambda i, w: AttentionSpec(layer_idx=i, num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=w,
                                    cache_layer=i)
    specs = {0: mk(0, 4), 1: mk(1, None), 2: mk(2, 4), 3: mk(3, None)}
    cfg = SparseKVConfig.from_engine_config(EngineConfig(sparse_method="omnikv", omnikv_filter_layers="2"))
    with pytest.raises(ValueError, match="layer 2 is not a full-attention layer"):
        SparseKV(cfg, specs, torch.device("cpu"), 4, 16)
    cfg = SparseKVConfig.from_engine_config(EngineConfig(sparse_method="omnikv"))
    sk = SparseKV(cfg, specs, torch.device("cpu"), 4, 16)
    assert (specs[1].omnikv, specs[3].omnikv, specs[0].omnikv) == ("filter", "sparse", None)
    assert sk.index.shape[0] >= 4 and sk.index.shape[1] == cfg.budget
    cfg = SparseKVConfig.from_engine_config(EngineConfig(sparse_method="streamingllm", sparse_sink_tokens=2))
    with pytest.raises(ValueError, match="rope"):  # no inv_freq on these specs: sinks cannot be re-positioned
        SparseKV(cfg, {i: mk(i, w) for i, w in [(0, 4), (1, None)]}, torch.device("cpu"), 4, 16)


# ---- the engine on tiny checkpoints ------------------------------------------------------------

BASE = dict(enforce_eager=True, dtype="float32", block_size=4, max_model_len=320, num_kv_blocks=240, max_num_seqs=4)
S, W, BUDGET, RECENT = 4, 12, 16, 4  # StreamingLLM keeps 4 + 12 tokens; OmniKV attends to 16 (4 sink, 4 recent)
METHODS = {
    "dense": {},
    "streamingllm": dict(sparse_method="streamingllm", sparse_sink_tokens=S, sparse_window=W),
    "omnikv": dict(sparse_method="omnikv", sparse_sink_tokens=S, omnikv_budget=BUDGET, omnikv_recent=RECENT),
}
LONG = 8 * BUDGET + 8  # prompts at least 8x the budget


@pytest.fixture(scope="module")
def tiny_llms(tiny_ckpt):
    """dense / streamingllm / omnikv engines on the hybrid tiny model (sliding + full layers), built once."""
    folder, _ = tiny_ckpt("dense")
    return {name: LLM(str(folder), **BASE, **kw) for name, kw in METHODS.items()}


def test_lossless_settings_equal_dense(tiny_ckpt):
    """A window / budget covering the whole context gives dense attention exactly, on the model with
    every Gemma 4 feature (K=V and shared-KV global layers, sliding window 7, soft-cap, MoE, PLE)."""
    folder, _ = tiny_ckpt("all")
    prompts = _prompts([50, 23], seed=3)
    outs = {}
    for name, kw in [("dense", {}), ("streamingllm", dict(sparse_method="streamingllm", sparse_window=400)),
                     ("omnikv", dict(sparse_method="omnikv", omnikv_budget=400))]:
        llm = LLM(str(folder), **BASE, **kw)
        outs[name] = greedy(llm, prompts, 10)
    assert outs["streamingllm"] == outs["dense"]
    assert outs["omnikv"] == outs["dense"]


def test_streamingllm_block_count_stays_bounded(tiny_llms):
    llm = tiny_llms["streamingllm"]
    eng = llm.engine
    group = (W, S)
    assert set(eng.block_manager.pools) == {group, 12}  # no unbounded full-attention pool is left
    eng.add_request("long", _prompts([LONG])[0], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    peak = 0
    chunk_blocks = -(-eng.config.max_num_batched_tokens // 4)
    while eng.has_unfinished_requests():
        eng.step()
        used = eng.block_manager.pools[group].num_used
        peak = max(peak, used)
        if eng.requests and eng.requests["long"].seqs[0].num_computed_tokens > LONG:
            assert used <= 1 + 4 + 1, used  # sink block + window blocks (+1 partial): per sequence, forever
    assert peak <= 1 + 4 + 1 + chunk_blocks
    assert LONG + 64 > 8 * (S + W)


def test_stats_report_attended_versus_cached(tiny_llms):
    prompt = _prompts([LONG], seed=1)
    n = 10
    for name in ("streamingllm", "omnikv"):
        llm = tiny_llms[name]
        out = llm.generate([{"prompt_token_ids": prompt[0]}], SamplingParams(temperature=0, max_tokens=n,
                                                                              ignore_eos=True))[0]
        m = out.metrics
        ctx = [LONG + i for i in range(1, n)]  # decode steps: context lengths (first token came from prefill)
        if name == "streamingllm":  # 2 full layers, each attends to sinks + window
            assert m.sparse_attended_tokens == 2 * (S + W) * len(ctx)
            assert m.sparse_attended_tokens <= m.sparse_cached_tokens < 2 * (S + W + 8) * len(ctx)
        else:  # layer 1 filters (dense), layer 3 attends to the budget; the full cache is kept
            assert m.sparse_attended_tokens == sum(c + BUDGET for c in ctx)
            assert m.sparse_cached_tokens == sum(2 * c for c in ctx)
        stats = llm.engine.get_stats()
        assert stats["sparse_method"] == name and stats["sparse_attended_tokens"] >= m.sparse_attended_tokens


def test_greedy_agreement_and_perplexity_against_dense(tiny_llms):
    """Reported, not judged: on a random tiny model any lossy method drifts; they must be finite and
    the sparse methods must attend to fewer tokens than they cache."""
    prompts = _prompts([LONG, LONG + 40], seed=2)
    ref = greedy(tiny_llms["dense"], prompts, 24)
    ppl_dense = perplexity(teacher_forced_logprobs(tiny_llms["dense"], prompts[0], ref[0][:16]))
    report = {}
    for name in ("streamingllm", "omnikv"):
        toks = greedy(tiny_llms[name], prompts, 24)
        agree = [agreement(t, r) for t, r in zip(toks, ref)]
        ppl = perplexity(teacher_forced_logprobs(tiny_llms[name], prompts[0], ref[0][:16]))
        report[name] = dict(match_rate=[round(a["match_rate"], 3) for a in agree],
                            first_divergence=[a["first_divergence"] for a in agree],
                            ppl_dense=round(ppl_dense, 3), ppl=round(ppl, 3))
        assert math.isfinite(ppl) and math.isfinite(ppl_dense) and ppl_dense >= 1.0
    print("\nsparse KV vs dense (tiny random model, prompts %d/%d tokens, budget %d): %s"
          % (LONG, LONG + 40, BUDGET, json.dumps(report)))


@pytest.mark.parametrize("method", ["streamingllm", "omnikv"])
def test_chunked_prefill_and_prefix_cache_change_nothing(tiny_ckpt, tiny_llms, method):
    """Chunked prefill (16-token chunks) with prefix-cache hits gives the tokens of one-shot prefill
    without a prefix cache, on the second turn of conversations."""
    folder, _ = tiny_ckpt("dense")
    cached = LLM(str(folder), **{**BASE, "max_num_batched_tokens": 16}, **METHODS[method])
    plain = tiny_llms[method]  # prefix cache on but cold for these prompts; one-shot prefill
    first = _prompts([LONG, 90], seed=4)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    turn1 = cached.generate([{"prompt_token_ids": x} for x in first], p)
    follow = [x + o.outputs[0].token_ids + [7, 8, 9] for x, o in zip(first, turn1)]
    turn2 = cached.generate([{"prompt_token_ids": x} for x in follow], p)
    ref = plain.generate([{"prompt_token_ids": x} for x in follow], p)
    assert [o.outputs[0].token_ids for o in turn2] == [o.outputs[0].token_ids for o in ref]
    assert all(o.num_cached_tokens >= (len(x) // 4 - 1) * 4 for x, o in zip(first, turn2))
    assert [o.outputs[0].token_ids for o in turn1] == greedy(plain, first, 12)


# ---- needle in a haystack --------------------------------------------------------------------

NEEDLE, YES, NO = 5, 6, 7  # token ids; the haystack uses 8..63
U, J = 5, 6  # an unrotated head dim (full layers rotate only a quarter of the angles), and a value dim


def _needle_model(folder):
    """A 4-layer Gemma 4 (sliding, full, sliding, full) whose full layers look for one token: every
    query matches the needle's key in an unrotated dimension (score 16 against 0 for any other key), the
    needle's value pushes the output to YES and every other value to NO. Sliding layers and MLPs add
    nothing. So the next token is YES exactly when a full layer still attends to the needle."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=64, hidden_size=64,
               intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               global_head_dim=16, sliding_window=8, max_position_embeddings=4096, final_logit_softcapping=None,
               hidden_size_per_layer_input=0, tie_word_embeddings=True, torch_dtype="float32", rms_norm_eps=1e-6,
               layer_types=["sliding_attention", "full_attention"] * 2, eos_token_id=1, bos_token_id=2,
               pad_token_id=0)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@torch.no_grad()
def _install_needle_weights(llm):
    model = llm.engine.executor.runner.model.model
    g = torch.Generator().manual_seed(0)
    emb = torch.zeros(64, 64)
    emb[:, 8:] = 0.1 * torch.randn(64, 56, generator=g)
    emb[:, 0] = 1.0  # a constant direction every query reads
    for t, d, val in [(NEEDLE, 1, 10.0), (YES, 2, 1.0), (NO, 2, -1.0)]:
        emb[t, 1:] = 0
        emb[t, d] = val
    model.embed_tokens.weight.copy_(emb)
    model.norm.weight.fill_(1.0)
    for i, layer in enumerate(model.layers):
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm):
            norm.weight.fill_(1.0)
        layer.layer_scalar.fill_(1.0)
        layer.mlp.down_proj.weight.zero_()
        attn = layer.self_attn
        if i % 2 == 0:  # sliding layers: no output
            attn.o_proj.weight.zero_()
            continue
        attn.q_norm.weight.fill_(1.0)
        attn.k_norm.weight.fill_(1.0)
        q = torch.zeros(4 * 16, 64)
        q[torch.arange(4) * 16 + U, 0] = 1.0
        kv_weights = []
        for dim, rows in ((U, [(1, 1.0)]), (J, [(1, 1.0), (0, -0.3)])):  # k, then v
            w = torch.zeros(2 * 16, 64)
            w[:, 8:] = 0.3 * torch.randn(32, 56, generator=g)
            for kv in range(2):
                w[kv * 16 + dim] = 0
                for src, val in rows:
                    w[kv * 16 + dim, src] = val
            kv_weights.append(w)
        attn.qkv_proj.weight.copy_(torch.cat([q, *kv_weights]))  # the merged [q; k; v] projection
        o = torch.zeros(64, 64)
        o[2, torch.arange(4) * 16 + J] = 1.0
        attn.o_proj.weight.copy_(o)
        layer.post_attention_layernorm.weight[2] = 10.0


def test_needle_in_a_haystack(tmp_path):
    """OmniKV keeps retrieving the needle (its filter layer picks it at every decode step) and answers
    like dense attention; StreamingLLM, at the same budget, has released the needle's block and answers
    otherwise. The prompt is 8x the budget; the needle sits past the sinks, far outside the window."""
    folder = _needle_model(tmp_path / "needle")
    budget, pos, n_out = 32, 40, 12
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(8, 64, (8 * budget,), generator=g).tolist()
    prompt[pos] = NEEDLE
    kw = dict(enforce_eager=True, load_format="dummy", skip_tokenizer_init=True, block_size=4, max_model_len=512,
              num_kv_blocks=200, max_num_batched_tokens=64)
    methods = {"dense": {}, "streamingllm": dict(sparse_method="streamingllm", sparse_sink_tokens=4,
                                                 sparse_window=budget - 4),
               "omnikv": dict(sparse_method="omnikv", sparse_sink_tokens=4, omnikv_budget=budget, omnikv_recent=8)}
    outs, seen, released = {}, [], []
    for name, extra in methods.items():
        llm = LLM(str(folder), **kw, **extra)
        _install_needle_weights(llm)
        eng = llm.engine
        eng.add_request(name, prompt, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
        while eng.has_unfinished_requests():
            out = eng.step()
            seq = eng.requests[name].seqs[0] if name in eng.requests else None
            if seq is None or seq.num_computed_tokens <= len(prompt):
                continue
            if name == "omnikv":  # the pick of this decode step
                seen.append(pos in eng.executor.runner.sparse.index[0].tolist())
            if name == "streamingllm":
                released.append(seq.block_tables[(budget - 4, 4)][pos // 4] == -1)
        outs[name] = out[0].outputs[0].token_ids
    assert outs["dense"] == [YES] * n_out
    assert outs["omnikv"] == outs["dense"]
    assert seen and all(seen)
    assert outs["streamingllm"] == [NO] * n_out
    assert released and all(released)
    # and with the needle inside StreamingLLM's window, it answers YES too
    llm = LLM(str(folder), **kw, **methods["streamingllm"])
    _install_needle_weights(llm)
    short = prompt[pos - 10:]
    assert greedy(llm, [short[:20]], 4)[0] == [YES] * 4


# ---- API and server ----------------------------------------------------------------------------


@pytest.mark.slow
def test_server_runs_omnikv(tiny_ckpt):
    """`serve --sparse-method omnikv` answers completions and reports the method in its stats."""
    import httpx
    from server_utils import ServerProcess

    folder, _ = tiny_ckpt("dense")
    srv = ServerProcess("--model", str(folder), "--sparse-method", "omnikv", "--omnikv-budget", "16",
                        "--omnikv-recent", "4", "--max-model-len", "256", "--num-kv-blocks", "128", "--block-size", "4",
                        "--dtype", "float32", "--enforce-eager")
    try:
        prompt = list(range(3, 3 + 120))
        r = httpx.post(srv.url + "/v1/completions", json={"model": folder.name, "prompt": prompt, "max_tokens": 6,
                                                          "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
    finally:
        assert srv.terminate() == 0, srv.output()
    assert "omnikv: filter layers [1], sparse layers [3]" in srv.output()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["streamingllm", "omnikv"])
def test_tensor_parallel_matches_one_process(tiny_ckpt, tiny_llms, method):
    """TP=2 (gloo, 2 processes): each rank holds half the heads; OmniKV sums the filter scores over the
    ranks, so every rank picks the same tokens, and the tokens equal one process's."""
    folder, _ = tiny_ckpt("dense")
    prompts = _prompts([LONG, 50], seed=6)
    ref = greedy(tiny_llms[method], prompts, 12)
    llm = LLM(str(folder), **BASE, **METHODS[method], tensor_parallel_size=2)
    try:
        assert {s.num_heads for s in llm.engine.executor.runner.specs.values()} == {2}
        assert greedy(llm, prompts, 12) == ref
        assert llm.engine.get_stats()["sparse_attended_tokens"] > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_benchmark_smoke_on_cpu(tmp_path):
    """benchmarks/sparse_kv.py at tiny sizes: every method runs, StreamingLLM holds less KV than dense; two
    requests whose prefills are staggered (one prompt a step) still give decode steps over the whole batch."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(root / "benchmarks" / "sparse_kv.py"), "--tiny", "--device", "cpu", "--dtype",
           "float32", "--lengths", "384", "--output", "6", "--sparse-window", "28", "--omnikv-budget", "32",
           "--omnikv-recent", "8", "--batch", "2", "--max-num-batched-tokens", "384", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=root, capture_output=True, timeout=300)
    rows = json.loads(next(tmp_path.glob("sparse_kv_tiny_*.json")).read_text())["rows"]
    by = {r["method"]: r for r in rows}
    assert set(by) == {"dense", "streamingllm", "omnikv"}
    assert by["streamingllm"]["peak_kv_MiB"] < by["dense"]["peak_kv_MiB"]
    # the batch each method's KV memory holds: StreamingLLM's windows, many more sequences than dense's full
    # context (2x here: the tiny model's sliding layers hold as much as its global ones at 390 tokens)
    assert (by["streamingllm"]["kv_batch_limit"] >= 2 * by["dense"]["kv_batch_limit"]
            >= 2 * by["omnikv"]["kv_batch_limit"])
    assert by["omnikv"]["attended_per_cached"] < 1.0
    # step 1: the first prompt (384 tokens, the whole step); 2: its first decode beside 383 of the second
    # prompt; 3: the second's last prompt token; 4-5: both decode; 6: the first finishes (not counted)
    for r in rows:
        assert r["full_batch_steps"] == 2 and r["decode_tok_s"] > 0 and r["prefill_s"] > 0, r


def test_benchmark_synthetic_prefill_and_batch_limit(tmp_path):
    """benchmarks/sparse_kv.py --synthetic-prefill (decode-only figures for batches whose prefill would not fit
    a device call): the prompt steps skip the model, every request still decodes over whole-batch steps; the
    batch the KV memory holds does not follow max_num_seqs (the planner sizes sliding groups for it)."""
    import sys
    from pathlib import Path

    from side_by_side import run_side_by_side

    root = Path(__file__).resolve().parent.parent

    def cmd(batch: int, output: int) -> list[str]:
        return [sys.executable, str(root / "benchmarks" / "sparse_kv.py"), "--tiny", "--device", "cpu", "--dtype",
                "float32", "--lengths", "384", "--output", str(output), "--methods", "dense", "--batch", str(batch),
                "--max-num-batched-tokens", "384", "--synthetic-prefill", "--enforce-eager", "--out",
                str(tmp_path / f"{batch}x{output}")]

    # the three runs side by side (tests/side_by_side.py); the last: an output too short for any whole-batch
    # decode step
    runs = run_side_by_side(*(dict(args=cmd(batch, output), timeout=300)
                              for batch, output in ((1, 10), (3, 10), (3, 4))))
    limits = {}
    for batch, done in zip((1, 3), runs):
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (row,) = json.loads(next((tmp_path / f"{batch}x10").glob("sparse_kv_tiny_*.json")).read_text())["rows"]
        # a 384-token prompt a step at most (the budget), a decode row's token beside the next prompt's chunk
        assert row["synthetic_prefill"] and batch <= row["skipped_prefill_steps"] <= 2 * batch, row
        assert row["full_batch_steps"] >= 2 and row["decode_tok_s"] > 0, row
        limits[batch] = row["kv_batch_limit"]
    assert limits[1] == limits[3] > 3, limits
    # an output too short for any whole-batch decode step is a one-line error, not a row without figures
    r = runs[2]
    assert r.returncode == 2 and "leaves no step with the whole batch decoding" in r.stderr, r.stderr[-500:]


@pytest.mark.slow
def test_demo_model_agreement_and_perplexity():
    """On the built-in demo model (real text, prompts 8x the budget): report greedy agreement and the
    perplexity of the text's continuation, dense vs each method."""
    from compiled_llm.config import DEMO_MODEL_DIR

    if not (DEMO_MODEL_DIR / "config.json").exists():
        pytest.skip("the demo model is not built (scripts/make_demo_model.py)")
    from pydoc_data.topics import topics

    budget = 64
    kw = dict(enforce_eager=True, dtype="float32", max_model_len=1024, num_kv_blocks=256, max_num_seqs=2)
    methods = {"dense": {}, "streamingllm": dict(sparse_method="streamingllm", sparse_sink_tokens=4,
                                                 sparse_window=budget - 4),
               "omnikv": dict(sparse_method="omnikv", sparse_sink_tokens=4, omnikv_budget=budget, omnikv_recent=16)}
    llms = {name: LLM(**kw, **extra) for name, extra in methods.items()}
    text = []
    for key in sorted(topics):
        text += llms["dense"].engine.tokenize(topics[key], add_special_tokens=not text)
        if len(text) > 8 * budget + 64:
            break
    prompt, target = text[:8 * budget], text[8 * budget:8 * budget + 64]
    ref = greedy(llms["dense"], [prompt], 48)[0]
    report = {}
    for name, llm in llms.items():
        ppl = perplexity(teacher_forced_logprobs(llm, prompt, target))
        report[name] = dict(ppl=round(ppl, 3), **agreement(greedy(llm, [prompt], 48)[0], ref))
        assert math.isfinite(ppl)
    print("\ndemo model, prompt %d tokens, budget %d: %s" % (len(prompt), budget, json.dumps(report)))


@pytest.mark.parametrize("method", ["streamingllm", "omnikv"])
def test_compiled_equals_eager(tiny_ckpt, tiny_llms, method):
    """A sparse method no longer switches the compiler off: the pieces between attention ops are compiled with
    the passes (fusion_check=error), the sparse attention runs between them, and the tokens equal eager's."""
    folder, _ = tiny_ckpt("dense")
    prompts = _prompts([LONG, 40], seed=5)
    want = greedy(tiny_llms[method], prompts, 12)
    llm = LLM(str(folder), **{**BASE, "enforce_eager": False, "fusion_check": "error"}, **METHODS[method])
    compiler = llm.engine.executor.runner.compiler
    assert compiler is not None and compiler.summary()["pieces"] >= 2
    assert greedy(llm, prompts, 12) == want


# ---- OmniKV offload ----------------------------------------------------------------------------


@pytest.mark.parametrize("extra, message", [
    (dict(sparse_method="streamingllm", omnikv_offload=True), "apply to sparse_method omnikv only"),
    (dict(omnikv_offload=False, omnikv_host_memory_gb=1.0), "not offloaded"),
    (dict(omnikv_offload=True, omnikv_host_memory_gb=0.0), "must be > 0"),
    (dict(omnikv_offload=True, tensor_parallel_size=2), "one process only"),
])
def test_omnikv_offload_flags_are_checked(extra, message):
    from compiled_llm.config import EngineConfig

    cfg = EngineConfig(device="cpu", **{**METHODS["omnikv"], **extra})
    with pytest.raises(ValueError, match=message):
        SparseKVConfig.from_engine_config(cfg)


def test_omnikv_offload_default_follows_the_device():
    from compiled_llm.config import EngineConfig

    assert not SparseKVConfig.from_engine_config(EngineConfig(device="cpu", **METHODS["omnikv"])).offload
    assert SparseKVConfig.from_engine_config(EngineConfig(device="cpu", omnikv_offload=True,
                                                          **METHODS["omnikv"])).offload
    # the CUDA default, decided from the config alone (no GPU needed to ask)
    cfg = EngineConfig(device="cpu", **METHODS["omnikv"])
    cfg.device = "cuda"
    assert SparseKVConfig.from_engine_config(cfg).offload
    cfg.tensor_parallel_size = 2
    assert not SparseKVConfig.from_engine_config(cfg).offload


def test_omnikv_offload_moves_the_sparse_layers_cache_out_of_the_device_budget(tiny_ckpt):
    """Offload on (the CPU runs it when asked): the sparse layers' caches leave the KV budget, so the full
    group gets more blocks from the same bytes; the host cap binds when it is smaller; the offloaded bytes
    are reported; tokens equal the engine without offload (the same attention, other memory)."""
    folder, _ = tiny_ckpt("dense")
    kw = {k: v for k, v in BASE.items() if k != "num_kv_blocks"}
    kw["kv_cache_memory_bytes"] = 6 << 20
    on = LLM(str(folder), **kw, **METHODS["omnikv"], omnikv_offload=True)
    off = LLM(str(folder), **kw, **METHODS["omnikv"])
    runner = on.engine.executor.runner
    sparse = runner.sparse
    sparse_layers = [i for i, r in sparse.roles.items() if r == "sparse"]
    assert sparse.offloaded == sparse_layers and sparse_layers
    assert all(runner.specs[i].offloaded == (i in sparse_layers) for i in runner.specs)
    device_b, host_b = runner.group_block_bytes()[None], runner.group_block_bytes(offloaded=True)[None]
    blocks_on = on.engine.block_manager.pools[None].num_blocks
    blocks_off = off.engine.block_manager.pools[None].num_blocks
    assert blocks_on > blocks_off * (device_b + host_b) // device_b * 0.9 and blocks_on > blocks_off
    assert on.engine.get_stats()["omnikv_offloaded_kv_bytes"] == blocks_on * host_b
    assert off.engine.get_stats()["omnikv_offloaded_kv_bytes"] == 0
    # the device buffers decode steps stage the picks in: max_num_seqs x budget tokens per offloaded layer
    spec = runner.specs[sparse_layers[0]]
    per_token = (1 if spec.k_eq_v else 2) * spec.num_kv_heads * spec.head_dim * 4
    want = len(sparse_layers) * kw.get("max_num_seqs", 8) * sparse.cfg.budget * per_token
    assert on.engine.get_stats()["omnikv_staging_bytes"] == want == sparse.staging_bytes
    assert off.engine.get_stats()["omnikv_staging_bytes"] == 0
    prompts = _prompts([LONG, 40, LONG + 11], seed=9)
    assert greedy(on, prompts, 10) == greedy(off, prompts, 10)
    # a host cap below the device's share sets the blocks
    cap_blocks = blocks_off // 2 + 90
    capped = LLM(str(folder), **kw, **METHODS["omnikv"], omnikv_offload=True,
                 omnikv_host_memory_gb=(cap_blocks * host_b + host_b // 2) / 2 ** 30)
    assert capped.engine.block_manager.pools[None].num_blocks == cap_blocks
    for llm in (on, off, capped):
        llm.engine.shutdown()
    # a one-process engine's shutdown releases its cache, pinned host memory and staging buffers (another
    # engine in this process then finds them free), and a second shutdown does nothing
    assert runner.kv_caches == {} and runner.mapped_host.bytes == 0 and not sparse.staging
    on.engine.shutdown()
    with pytest.raises(ValueError, match="omnikv_host_memory_gb"):  # less than one max_model_len sequence
        LLM(str(folder), **kw, **METHODS["omnikv"], omnikv_offload=True, omnikv_host_memory_gb=40 * host_b / 2 ** 30)


def test_device_view_aliases_the_host_bytes():
    """runtime/host_memory.device_view (the offloaded cache's device tensor over pinned host memory), run on
    the CPU: same shape, dtype and strides, and a write through either side shows in the other."""
    from compiled_llm.runtime.host_memory import device_view

    host = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4).to(torch.bfloat16)
    view = device_view(host, torch.device("cpu"))
    assert view.shape == host.shape and view.dtype == host.dtype and view.stride() == host.stride()
    assert torch.equal(view, host) and view.data_ptr() == host.data_ptr()  # the first element restored
    view[1, 2].fill_(-5.0)
    assert (host[1, 2] == -5.0).all()
    host[0, 0].zero_()
    assert (view[0, 0] == 0).all()
