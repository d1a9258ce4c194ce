"""Sparse KV quality that can fail (issue 19, item 3): needles in long prompts and a perplexity run over a
long generated text, dense vs StreamingLLM vs OmniKV, on a hand-built tiny Gemma 4.

Random tiny weights cannot retrieve anything, so the model is built to: its full-attention layers look
for "fact" tokens F_j (every query matches a fact's key, score 16 against 0 for any other key) and the
last full layer writes the fact's identity into the answer token A_j's direction; sliding layers and MLPs
add nothing. The *filter* layer (layer 1) scores like the others but writes nothing, so the answer comes
from the sparse layer (layer 3) alone: under OmniKV it is right only if the filter layer picked the fact
and the sparse layer attended to the pick. Dense attention therefore answers A_j for a prompt holding F_j,
and the perplexity of a text whose continuation names the planted facts is about the number of facts.

Asserted: dense retrieves every needle (the construction works); OmniKV retrieves every needle, picks the
fact's position at every decode step, and its perplexity stays within PPL_MARGIN of dense; StreamingLLM at
the same budget loses the needles outside its window (reported and asserted as lost, and a needle inside
the window is kept, so the loss is the window's). A deliberately broken OmniKV (a pick that ignores the
filter's scores) fails the same checks, so the checks can fail.
"""

from __future__ import annotations

import json
import math

import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.ops import sparse as sparse_ops
from compiled_llm.runtime.sparse_eval import perplexity, teacher_forced_logprobs

VOCAB, HIDDEN, HEAD_DIM = 64, 64, 32
FACTS = [8, 9, 10, 11]  # F_j
ANSWERS = [12, 13, 14, 15]  # A_j
HAY = (16, VOCAB)  # haystack token ids
U = 5  # the key dimension queries match (unrotated: full layers rotate a quarter of the angles)
VDIMS = [6, 7, 22, 23]  # value dimension carrying fact j
BUDGET, SINK, RECENT = 32, 4, 8
LENGTH = 8 * BUDGET  # prompts 8x the budget
PPL_MARGIN = 0.05  # OmniKV's perplexity within 5% of dense
N_OUT = 6

KW = dict(enforce_eager=True, load_format="dummy", skip_tokenizer_init=True, block_size=4, max_model_len=512,
          num_kv_blocks=800, max_num_batched_tokens=128, max_num_seqs=8, dtype="float32")
METHODS = {
    "dense": {},
    "streamingllm": dict(sparse_method="streamingllm", sparse_sink_tokens=SINK, sparse_window=BUDGET - SINK),
    "omnikv": dict(sparse_method="omnikv", sparse_sink_tokens=SINK, omnikv_budget=BUDGET, omnikv_recent=RECENT),
}


def retrieval_model(folder):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=VOCAB, hidden_size=HIDDEN,
               intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=HEAD_DIM, global_head_dim=HEAD_DIM, sliding_window=8, max_position_embeddings=4096,
               final_logit_softcapping=None, hidden_size_per_layer_input=0, tie_word_embeddings=False,
               torch_dtype="float32", rms_norm_eps=1e-6, layer_types=["sliding_attention", "full_attention"] * 2,
               eos_token_id=1, bos_token_id=2, pad_token_id=0)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@torch.no_grad()
def install_retrieval_weights(llm):
    model = llm.engine.executor.runner.model.model
    g = torch.Generator().manual_seed(0)
    emb = torch.zeros(VOCAB, HIDDEN)
    emb[ANSWERS[0]:, 24:] = 0.1 * torch.randn(VOCAB - ANSWERS[0], HIDDEN - 24, generator=g)  # answers, haystack
    emb[:, 0] = 1.0  # a constant direction every query reads
    head = emb.clone()  # untied output embedding: only the answers read the facts' directions
    head[:, 0] = 0.0
    for j, (f, a) in enumerate(zip(FACTS, ANSWERS)):
        emb[f, 1] = 10.0  # "I am a fact"
        emb[f, 3 + j] = 10.0  # which one
        head[a] = 0.0
        head[a, 10 + j] = 3.0  # the answer's readout (a logit of about 3 x 8 / sqrt(facts in sight))
    model.embed_tokens.weight.copy_(emb)
    llm.engine.executor.runner.model.lm_head.weight.copy_(head)
    model.norm.weight.fill_(1.0)
    hd, kvh, heads = HEAD_DIM, 2, 4
    for i, layer in enumerate(model.layers):
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm):
            norm.weight.fill_(1.0)
        layer.layer_scalar.fill_(1.0)
        layer.mlp.down_proj.weight.zero_()
        attn = layer.self_attn
        attn.o_proj.weight.zero_()
        if i % 2 == 0:  # sliding layers: no output
            continue
        attn.q_norm.weight.fill_(1.0)
        attn.k_norm.weight.fill_(1.0)
        q = torch.zeros(heads * hd, HIDDEN)
        q[torch.arange(heads) * hd + U, 0] = 1.0
        k = torch.zeros(kvh * hd, HIDDEN)
        k[:, 24:] = 0.3 * torch.randn(kvh * hd, HIDDEN - 24, generator=g)
        v = k.clone().normal_(generator=g).mul_(0.3)
        v[:, :24] = 0
        for h in range(kvh):
            k[h * hd + U] = 0
            k[h * hd + U, 1] = 1.0
            for j, dim in enumerate(VDIMS):
                v[h * hd + dim] = 0
                v[h * hd + dim, 3 + j] = 1.0
        attn.qkv_proj.weight.copy_(torch.cat([q, k, v]))  # the merged [q; k; v] projection
        if i == 3:  # the last full layer answers; the first (OmniKV's filter) only scores
            o = torch.zeros(HIDDEN, heads * hd)
            for j, dim in enumerate(VDIMS):
                o[10 + j, torch.arange(heads) * hd + dim] = 1.0
            attn.o_proj.weight.copy_(o)
            layer.post_attention_layernorm.weight[10:14] = 10.0


def haystack(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(HAY[0], HAY[1], (n,), generator=g).tolist()


# needles: (fact index, position); the last one sits inside StreamingLLM's window
NEEDLES = [(0, 20), (1, 90), (2, 150), (3, 205), (1, LENGTH - 10)]


def run_checks(llm, name: str, needles=NEEDLES, length: int = LENGTH, n_out: int = N_OUT, text_len: int = 480,
               target_len: int = 32) -> dict:
    """Needle retrieval (greedy, a batch of prompts) and the teacher-forced perplexity of a long text's
    continuation; for OmniKV also whether each decode step's pick held the needle."""
    eng = llm.engine
    prompts = []
    for k, (j, pos) in enumerate(needles):
        p = haystack(length, seed=k)
        p[pos] = FACTS[j]
        prompts.append(p)
    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    for k, p in enumerate(prompts):
        eng.add_request(f"n{k}", p, params)
    picked = {k: [] for k in range(len(prompts))}
    outs = {}
    sk = eng.executor.runner.sparse
    step_rows = []  # the last step's rows: (prompt, decode row?)
    if sk is not None and sk.method == "omnikv":
        real = sk.metadata

        def recording(batch, count=True):
            sm = real(batch, count)
            step_rows[:] = [(int(item.seq.request_id[1:]), d) for item, d in zip(batch, sm.decode)]
            return sm

        sk.metadata = recording
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[int(o.request_id[1:])] = o.outputs[0].token_ids
        for row, (k, decode) in enumerate(step_rows):  # the pick the filter layer made for each decode row
            if decode:
                picked[k].append(needles[k][1] in sk.index[row].tolist())
        step_rows.clear()
    if step_rows is not None and sk is not None and sk.method == "omnikv":
        sk.metadata = real
    retrieved = [outs[k] == [ANSWERS[j]] * n_out for k, (j, _) in enumerate(needles)]
    # perplexity: a long text with three facts planted at different depths; its continuation names them in
    # turn (what dense attention predicts, each with about a third of the mass)
    text = haystack(text_len, seed=99)
    planted = {text_len // 16: 0, text_len * 5 // 12: 2, text_len * 11 // 16: 3}
    for pos, j in planted.items():
        text[pos] = FACTS[j]
    target = [ANSWERS[j] for j in planted.values()] * target_len
    ppl = perplexity(teacher_forced_logprobs(llm, text, target[:target_len]))
    return dict(method=name, retrieved=retrieved, pick_held_needle=picked, ppl=ppl)


def build(tmp_path, name, **overrides):
    llm = LLM(str(retrieval_model(tmp_path / "retrieval")), **{**KW, **METHODS[name], **overrides})
    install_retrieval_weights(llm)
    return llm


def omnikv_ok(res: dict, dense: dict) -> list[str]:
    """The reasons OmniKV's result fails the bar (empty: it passes)."""
    bad = []
    if not all(res["retrieved"]):
        bad.append(f"lost needles {[k for k, r in enumerate(res['retrieved']) if not r]}")
    missed = [k for k, steps in res["pick_held_needle"].items() if not steps or not all(steps)]
    if missed:
        bad.append(f"pick missed the needle for prompts {missed}")
    if not res["ppl"] <= dense["ppl"] * (1 + PPL_MARGIN):
        bad.append(f"perplexity {res['ppl']:.3f} vs dense {dense['ppl']:.3f} (margin {PPL_MARGIN:.0%})")
    return bad


def _report(results):
    return json.dumps({r["method"]: dict(retrieved=sum(r["retrieved"]), of=len(r["retrieved"]),
                                         ppl=round(r["ppl"], 3)) for r in results})


def test_needles_and_perplexity_dense_streamingllm_omnikv(tmp_path, monkeypatch):
    dense = run_checks(build(tmp_path, "dense"), "dense")
    assert all(dense["retrieved"]), f"the constructed model must retrieve every needle densely: {dense}"
    assert dense["ppl"] < 3.5, dense["ppl"]  # three facts, each about a third of the mass

    omni = run_checks(build(tmp_path, "omnikv"), "omnikv")
    assert omnikv_ok(omni, dense) == []

    stream = run_checks(build(tmp_path, "streamingllm"), "streamingllm")
    window_start = LENGTH - (BUDGET - SINK)
    inside = [pos >= window_start for _, pos in NEEDLES]
    # StreamingLLM's loss is reported and asserted: it keeps exactly the needles inside its window
    assert stream["retrieved"] == inside, stream["retrieved"]
    assert stream["ppl"] > 10 * dense["ppl"]  # the planted facts lie far outside its window

    # the checks can fail: OmniKV whose pick ignores the filter layer's scores keeps only sinks and recent
    # tokens plus the lowest positions, and fails them
    real = sparse_ops.omnikv_select
    monkeypatch.setattr(sparse_ops, "omnikv_select", lambda score, *a, **k: real(torch.zeros_like(score), *a, **k))
    broken = run_checks(build(tmp_path, "omnikv"), "omnikv (pick ignores scores)")
    failures = omnikv_ok(broken, dense)
    assert failures and any("lost needles" in f for f in failures) and any("perplexity" in f for f in failures)
    print("\nsparse KV quality, prompts %d tokens, budget %d: %s; broken OmniKV fails with: %s"
          % (LENGTH, BUDGET, _report([dense, omni, stream, broken]), "; ".join(failures)))
    assert math.isfinite(omni["ppl"])
