"""The compiler on the tiny Gemma 4 models (CPU: Inductor generates C++): fusion pass matches, graph
pieces around the attention ops, compiled greedy tokens against transformers and our eager engine,
static batch sizes (padding), and the JIT monitor.

Compiling is slow on two cores, so each model is compiled once per session and every test reads it.
"""

from __future__ import annotations

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.ops.jit import MONITOR, JitCompileAfterWarmup
from tiny_models import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
_LLMS: dict = {}


def prompts(vocab: int, lengths=(5, 17, 30)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def compiled(tiny_ckpt):
    """compiled(name) -> (LLM, transformers model); dense also compiles batch size 4 statically (padding)."""

    def get(name: str):
        if name not in _LLMS:
            folder, hf = tiny_ckpt(name)
            sizes = "4" if name == "dense" else "none"
            llm = LLM(str(folder), enforce_eager=False, block_size=4, max_model_len=128, num_kv_blocks=96,
                      cudagraph_batch_sizes=sizes, compile_sizes="all", jit_monitor="error", dtype="float32",
                      fusion_check="error")
            _LLMS[name] = (llm, hf)
        return _LLMS[name]

    return get


def summary(llm) -> dict:
    return llm.engine.executor.runner.compiler.summary()


def matches(llm) -> dict[str, int]:
    return {name: p["matches"] for name, p in summary(llm)["passes"].items()}


# One match per layer where the layer has the shape: 4 layers dense; 3 MoE layers, whose second add+norm
# (post-FFN norms summed, then normed) is a second RMSNorm + residual add match. An exact count, so a
# model change that breaks a match fails here. skinny_mm (a kernel choice, in total): every projection whose
# weight is a parameter goes to its oneDNN provider on the CPU (4 a layer: qkv, o, the dense MLP's gate_up and
# down; the MoE model's router product is the router_topk op's and its experts are geglu_moe's)
EXPECTED = {
    "dense": {"add_rms_norm": 4, "qk_norm_rope_kv_write": 4, "router_topk": 0, "geglu_moe": 0, "swiglu_moe": 0,
              "skinny_mm": 16},
    "moe": {"add_rms_norm": 6, "qk_norm_rope_kv_write": 3, "router_topk": 3, "geglu_moe": 3, "swiglu_moe": 0,
            "skinny_mm": 12},
}


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_each_applicable_pass_replaces_matches(compiled, name):
    llm, _ = compiled(name)
    assert matches(llm) == EXPECTED[name]


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_compiled_greedy_equals_transformers_and_eager(compiled, tiny_ckpt, name):
    llm, hf = compiled(name)
    ps = prompts(hf.config.vocab_size)
    ref = [hf_greedy(hf, p, GREEDY.max_tokens) for p in ps]
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert batched == ref
    # one at a time: decode steps of a single token (padded to the static size 4 on the dense model)
    assert [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in ps[:2]] == ref[:2]
    eager = LLM(str(tiny_ckpt(name)[0]), enforce_eager=True, block_size=4, max_model_len=128, num_kv_blocks=96,
                dtype="float32")
    assert [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in ps], GREEDY)] == ref
    assert not MONITOR.late  # nothing compiled after warm-up
    runner = llm.engine.executor.runner
    kv_eq = {i for i, spec in runner.specs.items() if runner.specs[spec.cache_layer].k_eq_v}
    assert runner.op_providers["attention"] == {i: "reference" if i in kv_eq else "cpu" for i in runner.specs}
    direct = runner.compiler.compiled.direct
    before = direct.calls
    llm.generate({"prompt_token_ids": ps[0]}, GREEDY)
    assert direct.calls > before  # the steps ran Dynamo's compiled code past its frame evaluation


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_cpu_projections_and_lm_head_stream_packed_weights(compiled, monkeypatch):
    """The CPU engine's fast path for its projections (ops/linear.py packed_mm): the compiled graph's qkv, o and MLP
    products and the LM head run through the parameters' oneDNN copies (pinned here: unpinned, a shape takes
    whichever library measured faster), each made once: a later request packs nothing again (on a weight the
    graph handed over as something other than the parameter, every step would repack)."""
    from compiled_llm.ops import linear

    monkeypatch.setattr(linear, "PINNED", "onednn")
    llm, hf = compiled("dense")
    assert linear.SKINNY_MM.provider_name() == "onednn"
    ps = [{"prompt_token_ids": p} for p in prompts(hf.config.vocab_size)]
    llm.generate(ps, GREEDY)
    packs = linear.PACKS[0]
    llm.generate(ps, GREEDY)
    assert linear.PACKS[0] == packs
    model = llm.engine.executor.runner.model
    packed = {name for name, w in model.named_parameters() if "_onednn_packed" in w.__dict__}
    projections = {name for name, w in model.named_parameters() if w.dim() == 2 and "layers." in name
                   and "norm" not in name}
    assert projections and projections <= packed  # every layer's 2-D weight: qkv, o, gate_up, down
    assert any("embed" in name or "lm_head" in name for name in packed)  # the (tied) LM head


def test_moe_in_bfloat16_gets_every_fusion_in_every_compile(tiny_ckpt):
    """bfloat16 graphs carry casts float32 graphs do not (torch 2.11 folds some of them): the MoE pattern
    once matched in float32 and missed in bfloat16. The static one-token bucket is checked too
    (fusion_check='error' raises at start-up on any layer that misses a declared fusion)."""
    folder, _ = tiny_ckpt("moe")
    kw = dict(block_size=4, max_model_len=128, num_kv_blocks=96, dtype="bfloat16")
    llm = LLM(str(folder), enforce_eager=False, cudagraph_batch_sizes="1", compile_sizes="all", fusion_check="error",
              jit_monitor="error", **kw)  # the one-token static graph: the one that differs most from the dynamic one
    shapes = llm.engine.executor.runner.compiler.compiled.matches_by_shape()
    assert sorted(shapes) == ["1", "dynamic"]
    assert matches(llm) == EXPECTED["moe"]
    ps = [{"prompt_token_ids": p} for p in prompts(llm.engine.executor.runner.model_config.vocab_size)]
    got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)]
    eager = LLM(str(folder), enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(ps, GREEDY)]
    assert got == want


def test_every_attention_op_sits_between_pieces(compiled):
    from compiled_llm.compiler.backend import is_split_node
    from compiled_llm.compiler.piecewise import PieceRunner

    llm, hf = compiled("dense")
    backend = llm.engine.executor.runner.compiler.compiled.backend
    split = backend.split_gm
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    kinds = []
    for node in calls:
        runner = split.__dict__.get(node.target)
        sub = split._modules[node.target]  # the graph (the runner that replaced it sits in __dict__)
        ops = [n for n in sub.graph.nodes if n.op == "call_function"]
        if isinstance(runner, PieceRunner):
            assert not any(is_split_node(n) for n in ops), f"{node.target} holds an attention op"
            kinds.append("piece")
        else:
            assert len(ops) == 1 and is_split_node(ops[0]), f"{node.target} is not a lone attention op: {ops}"
            kinds.append("attention")
    layers = hf.config.num_hidden_layers
    assert kinds == ["piece", "attention"] * layers + ["piece"]
    s = summary(llm)
    assert s["pieces"] == layers + 1 and s["attention_ops"] == layers
    assert s["static_sizes"] == [4] and s["captured_graphs"] == 0  # CPU: static compiles, no CUDA graphs
    assert all(4 in p.static for p in backend.pieces)  # warm-up compiled the static size


def test_a_compile_in_the_samplers_part_of_a_step_is_judged_too(compiled, monkeypatch):
    """--jit-monitor covers the whole engine step, not only the compiled forward: a kernel first built while
    sampling (the greedy argmax at a row width warm-up never saw, as on the H200 in session 36) is an error
    under 'error'."""
    from compiled_llm.runtime import sampler as S

    llm, hf = compiled("dense")
    engine = llm.engine
    real = S.argmax_rows

    def argmax_first_built_here(logits):
        MONITOR.note("argmax_rows", ("a width warm-up never saw",))
        return real(logits)

    monkeypatch.setattr(S, "argmax_rows", argmax_first_built_here)
    try:
        engine.add_request("late", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        with pytest.raises(JitCompileAfterWarmup, match="argmax_rows"):
            for _ in range(4):
                engine.step()
    finally:
        MONITOR.late.clear()
        MONITOR.seen.discard(("argmax_rows", ("a width warm-up never saw",)))
        engine.abort_request("late")
        while engine.has_unfinished_requests():
            engine.step()


def test_compile_after_warmup_is_an_error_under_jit_monitor_error(compiled):
    llm, hf = compiled("dense")
    model = llm.engine.executor.runner.compiler.compiled
    model.sizes.insert(0, 2)  # a batch size warm-up never saw: its first use compiles
    engine = llm.engine
    try:
        engine.add_request("late", [5, 6], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        with pytest.raises(JitCompileAfterWarmup, match="inductor"):
            engine.step()  # a 2-token prefill: the new static size
    finally:
        model.sizes.remove(2)
        MONITOR.late.clear()
        engine.abort_request("late")


def test_default_warm_up_covers_a_lone_decode_token(tiny_ckpt, monkeypatch):
    """With the defaults on the CPU (no static batch buckets, one graph: not split at attention), a one-sequence
    decode step has a single token; warm-up must compile that case too, or the first request would compile (an
    error here)."""
    from compiled_llm import LLM, SamplingParams

    monkeypatch.delenv("COMPILED_LLM_SPLIT_GRAPH", raising=False)  # the defaults, not the suite's split
    folder, _ = tiny_ckpt("dense")
    llm = LLM(str(folder), jit_monitor="error", skip_tokenizer_init=True)  # compiled, otherwise the defaults
    eager = LLM(str(folder), enforce_eager=True, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 17, 3, 11]}
    assert (llm.generate(prompt, params)[0].outputs[0].token_ids
            == eager.generate(prompt, params)[0].outputs[0].token_ids)


def test_cpu_engine_compiles_one_graph_by_default(tiny_ckpt, monkeypatch):
    """--split-graph auto on a CPU engine: the forward is one compiled piece and Inductor's code
    calls the attention ops itself (no piece boundary at each: less Python a step). Every feature of Gemma 4 in
    one graph: each layer still gets its fusions (the K=V layers' query and value branches, and every
    multi-output pattern, paired within a layer: passes/base.py _LayerAnchored), the static size compiles, and
    greedy tokens equal transformers', batched and one at a time."""
    from compiled_llm.compiler import split_graph
    from compiled_llm.compiler.backend import is_split_node
    from compiled_llm.config import EngineConfig

    monkeypatch.delenv("COMPILED_LLM_SPLIT_GRAPH", raising=False)
    assert split_graph("auto", torch.device("cpu"), []) is False
    assert split_graph("auto", torch.device("cuda"), [1, 2]) is split_graph("auto", torch.device("cuda"), []) is True
    assert split_graph("on", torch.device("cpu"), []) is True
    with pytest.raises(ValueError, match="cudagraph-batch-sizes none"):
        split_graph("off", torch.device("cuda"), [1, 2])
    folder, hf = tiny_ckpt("all")
    with pytest.raises(ValueError, match="split_graph must be auto, on or off"):
        EngineConfig(model=str(folder), split_graph="sometimes")
    llm = LLM(str(folder), enforce_eager=False, block_size=4, max_model_len=128, num_kv_blocks=96,
              cudagraph_batch_sizes="4", compile_sizes="all", jit_monitor="error", dtype="float32",
              fusion_check="error")
    backend = llm.engine.executor.runner.compiler.compiled.backend
    (piece,) = backend.pieces
    layers = hf.config.num_hidden_layers
    assert sum(is_split_node(n) for n in piece.gm.graph.nodes) == layers and 4 in piece.static
    s = summary(llm)
    assert s["pieces"] == 1 and s["attention_ops"] == 0
    assert matches(llm) == {"add_rms_norm": 2 * layers, "qk_norm_rope_kv_write": layers, "router_topk": layers,
                            "geglu_moe": layers, "swiglu_moe": 0, "skinny_mm": 43}
    ps = prompts(hf.config.vocab_size)
    ref = [hf_greedy(hf, p, GREEDY.max_tokens) for p in ps]
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)] == ref
    assert [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in ps[:2]] == ref[:2]
    assert not MONITOR.late


def test_by_default_buckets_pad_onto_the_dynamic_compile(tiny_ckpt):
    """The default (compile_sizes None, as 'none'): the batch buckets (padding; CUDA graphs on the GPU) replay
    the one dynamic compile per piece instead of a static compile each, the start-up saving measured on the
    H200; tokens equal eager's."""
    folder, _ = tiny_ckpt("dense")
    kw = dict(block_size=4, max_model_len=128, num_kv_blocks=96, dtype="float32")
    before = MONITOR.compiles["inductor"]
    llm = LLM(str(folder), enforce_eager=False, cudagraph_batch_sizes="2,4", jit_monitor="error", **kw)
    backend = llm.engine.executor.runner.compiler.compiled.backend
    pieces = backend.pieces
    assert MONITOR.compiles["inductor"] - before == len(pieces) - backend.shared_hits  # the dynamic compiles only
    assert all(p.static[s] is p.dynamic for p in pieces for s in (2, 4))
    ps = prompts(llm.engine.executor.runner.model_config.vocab_size)
    eager = LLM(str(folder), enforce_eager=True, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    want = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert got == want
    with pytest.raises(ValueError, match="not batch sizes"):
        LLM(str(folder), enforce_eager=False, cudagraph_batch_sizes="2,4", compile_sizes="3", **kw)


def test_buckets_above_max_num_seqs_are_prefill_graphs(tiny_ckpt, monkeypatch):
    """A bucket larger than max_num_seqs can only take a prompt (a piecewise CUDA graph on the GPU, which
    saves a long prompt the Python of every piece's launches): warm-up runs it as one sequence of that many
    tokens, with no whole-graph decode, so nothing compiles later (jit_monitor='error'); a 17- and a 30-token
    prompt then run padded in the 32-token bucket and a 40-token one dynamically; tokens equal eager's."""
    from compiled_llm.compiler.model import CompiledModel

    folder, _ = tiny_ckpt("dense")
    kw = dict(block_size=4, max_model_len=128, num_kv_blocks=96, dtype="float32", max_num_seqs=2)
    llm = LLM(str(folder), enforce_eager=False, cudagraph_batch_sizes="1,2,32", jit_monitor="error", **kw)
    items = list(llm.engine.executor.runner.compiler.warmup_seconds)
    assert "prefill size 32" in items and "batch size 32" not in items and "batch size 2" in items
    used = []
    forward = CompiledModel._forward
    monkeypatch.setattr(CompiledModel, "_forward", lambda self, ids, pos, size, *a: (
        used.append((ids.shape[0], size)), forward(self, ids, pos, size, *a))[1])
    ps = prompts(llm.engine.executor.runner.model_config.vocab_size, (17, 30, 40))
    eager = LLM(str(folder), enforce_eager=True, **kw)
    got = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in ps]
    want = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert got == want
    assert (32, 32) in used and (40, None) in used and (1, 1) in used


def test_look_alike_pieces_compile_once_and_keep_their_own_layers(tiny_ckpt):
    """The pieces between dense's 4 attention ops: [embed, layer 0], three alike [end of layer i, start of
    layer i + 1] and [end of layer 3, norm]. Our ops' layer indices are relative to a piece's first layer, so
    the three are one graph: one Inductor compile per shape serves them all, each still writes its own
    layer's KV cache (tokens equal eager's) and the fusion report still counts every layer."""
    folder, _ = tiny_ckpt("dense")
    kw = dict(block_size=4, max_model_len=128, num_kv_blocks=96, dtype="float32")
    before = MONITOR.compiles["inductor"]
    llm = LLM(str(folder), enforce_eager=False, cudagraph_batch_sizes="2,4", compile_sizes="all", jit_monitor="error",
              **kw)
    compiler = llm.engine.executor.runner.compiler
    pieces = compiler.compiled.backend.pieces
    assert [p.base for p in pieces] == [0, 0, 1, 2, 3]
    middle = pieces[1:4]
    assert all(p.dynamic is middle[0].dynamic and p.static[4] is middle[0].static[4] for p in middle)
    assert pieces[0].dynamic is not middle[0].dynamic
    assert MONITOR.compiles["inductor"] - before == 3 * 3  # 3 distinct pieces x (dynamic, 2, 4)
    assert compiler.summary()["shared_compiles"] == 2 * 3
    per_layer = compiler.compiled.matches_by_shape()["4"]
    assert {layer: per_layer[f"qk_norm_rope_kv_write@{layer}"] for layer in range(4)} == {0: 1, 1: 1, 2: 1, 3: 1}
    ps = prompts(llm.engine.executor.runner.model_config.vocab_size)
    eager = LLM(str(folder), enforce_eager=True, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    want = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert got == want


def test_warm_up_builds_attention_kernels_only_for_layers_that_launch_them(tiny_ckpt):
    """The `all` model mixes head_dim 16 (sliding: the reference, the Triton kernels need >= 32) and 32
    (global: Triton). Warm-up used to build the Triton kernel for every layer's key, and `tl.dot` at
    K=16 crashed the GPU start-up; now only the layers that chose Triton give keys."""
    import json

    from compiled_llm.runtime.audit import GPU
    from compiled_llm.compiler.warmup import kernel_keys
    from compiled_llm.models.gemma4 import Gemma4ForCausalLM
    from compiled_llm.ops.registry import model_facts, preserved_choices, select_providers

    cfg = Gemma4ForCausalLM.config_from_hf(json.loads((tiny_ckpt("all")[0] / "config.json").read_text()))
    with torch.device("meta"):
        specs = Gemma4ForCausalLM(cfg).attention_specs()
    facts = model_facts(cfg, block_size=16)
    with preserved_choices():
        table = select_providers("cuda", torch.bfloat16, specs, facts, caps=GPU)
        keys = [key for kernel, key in kernel_keys(dict(facts, dtype=torch.bfloat16, layers=specs))
                if kernel.name == "paged_attention"]
    assert {specs[i].head_dim for i, p in table["attention"].items() if p == "reference"} == {16}
    assert {specs[i].head_dim for i, p in table["attention"].items() if p == "triton"} == {32}
    assert keys and {key[2] for key in keys} == {32}  # ("attention", dtype, head_dim, ...)


def test_whole_graph_decode_needs_every_chosen_split_op_provider_capturable(tiny_ckpt):
    """Providers declare whether a CUDA graph can replay them (ops/registry.py Provider.capturable); the
    compiler no longer keeps its own list of names. `all` puts its head_dim-16 layers on the reference
    attention (host loops): no whole-graph decode; with head_dim 32 everywhere every layer is on Triton."""
    import json

    from compiled_llm.models.gemma4 import Gemma4ForCausalLM
    from compiled_llm.ops.registry import OPS, model_facts, preserved_choices, select_providers
    from compiled_llm.runtime.audit import GPU

    hf = json.loads((tiny_ckpt("all")[0] / "config.json").read_text())
    for head_dim, capturable in ((16, False), (32, True)):
        cfg = Gemma4ForCausalLM.config_from_hf(dict(hf, head_dim=head_dim))
        with torch.device("meta"):
            specs = Gemma4ForCausalLM(cfg).attention_specs()
        with preserved_choices():
            table = select_providers("cuda", torch.bfloat16, specs, model_facts(cfg, block_size=16), caps=GPU)
            assert ("reference" in table["attention"].values()) != capturable
            assert OPS["attention"].capturable() == capturable


def test_max_autotune_and_symm_mem_reach_the_compiles_they_name():
    """--max-autotune static: Inductor's GEMM autotuning in the static batch-size compiles (decode), not in the
    dynamic one; all: both; off: neither. Our passes and settings stay in every compile's config."""
    from types import SimpleNamespace

    from compiled_llm.compiler import parse_autotune
    from compiled_llm.compiler.backend import CompilerConfig
    from compiled_llm.compiler.piecewise import PieceRunner
    from compiled_llm.passes.manager import PassManager

    def patches(mode: str, shape: str, symm_mem: bool = False) -> dict:
        runner = PieceRunner.__new__(PieceRunner)
        runner.backend = SimpleNamespace(pass_manager=PassManager(), config=CompilerConfig(
            autotune=parse_autotune(mode), symm_mem_allreduce=symm_mem))
        return runner._inductor_config(shape)

    # --tp-allreduce symm-mem: the decode compiles only (Inductor cannot size-check a symbolic token count)
    assert patches("off", "8", symm_mem=True).get("_collective.auto_select") is True
    assert "_collective.auto_select" not in patches("off", "dynamic", symm_mem=True)
    assert "_collective.auto_select" not in patches("off", "8")

    assert patches("static", "8").get("max_autotune_gemm") is True
    assert "max_autotune_gemm" not in patches("static", "dynamic")
    assert patches("all", "dynamic").get("max_autotune_gemm") is True
    assert "max_autotune_gemm" not in patches("off", "8")
    assert patches("static", "8")["shape_padding"] is False and "post_grad_custom_pre_pass" in patches("off", "1")
    with pytest.raises(ValueError, match="max_autotune must be off, static or all"):
        parse_autotune("yes")


def test_cpu_engine_counts_norm_fusions_and_leaves_them_to_inductor(compiled, monkeypatch):
    """On the CPU the fused norm and QK-norm+RoPE ops could only run their PyTorch reference, op by op: the
    passes count every layer's match (the fusion check holds) but leave those computations to Inductor, so
    those ops never run, while the KV write (an op of the model's own graph) and the replaced MoE ops do.
    The pass unit tests (tests/passes) keep replacing."""
    from collections import Counter

    from compiled_llm.ops.registry import OPS

    calls = Counter()
    for name in ("qk_norm_rope_kv_write", "fused_add_rms_norm", "kv_cache_write", "geglu_moe", "router_topk"):
        spec = OPS[name]

        def impl(*args, _spec=spec, _name=name, _impl=spec.impl):
            calls[_name] += 1
            return _impl(*args)

        monkeypatch.setattr(spec, "impl", impl)
    llm, hf = compiled("moe")
    ps = prompts(hf.config.vocab_size)[:1]
    llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0.0, max_tokens=3))
    assert calls["kv_cache_write"] and calls["geglu_moe"] and calls["router_topk"]
    assert not calls["qk_norm_rope_kv_write"] and not calls["fused_add_rms_norm"]
    assert matches(llm) == EXPECTED["moe"]
    assert llm.engine.executor.runner.compiler.compiled.pass_manager.inductor_config()["emulate_precision_casts"]


def test_default_cuda_sizes_add_prompt_graphs_within_the_token_budget():
    """On CUDA the default buckets are the decode batches (powers of two up to max_num_seqs) and the prompt
    sizes above them (PREFILL_CUDA_SIZES) that fit one step's token budget; the CPU has none; a list given
    is taken as it is."""
    from compiled_llm.compiler import parse_sizes

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert parse_sizes(None, cuda, 8, 8192) == [1, 2, 4, 8, 256, 512, 1024]
    assert parse_sizes(None, cuda, 256, 8192) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert parse_sizes(None, cuda, 8, 600) == [1, 2, 4, 8, 256, 512]
    assert parse_sizes(None, cuda, 8) == [1, 2, 4, 8]
    assert parse_sizes(None, cpu, 8, 8192) == []
    assert parse_sizes("1,8", cuda, 8, 8192) == [1, 8] and parse_sizes("none", cuda, 8, 8192) == []


def test_forward_guards_skip_the_models_modules_and_keep_the_inputs():
    """The engine's torch.compile drops Dynamo's guards on the model's modules (their parameters' tensor checks cost
    ~0.27 ms a CPU decode step under torch 2.14) and keeps the inputs' (a new input dtype still recompiles); two
    compiles of look-alike models with their own backends (two engines) each run their own graph."""
    from compiled_llm.compiler.model import skip_module_guards

    kept = {}

    def record(entries):
        flags = skip_module_guards(entries)
        kept.update({e.name: keep for e, keep in zip(entries, flags)})
        return flags

    def backend_for(tag, calls):
        def backend(gm, example_inputs):
            def run(*args):
                calls.append(tag)
                return gm(*args)
            return run
        return backend

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(2)]
    calls = []
    compiled = [torch.compile(m, backend=backend_for(i, calls), fullgraph=True, dynamic=False,
                              options={"guard_filter_fn": record}) for i, m in enumerate(models)]
    x = torch.randn(3, 8)
    for i, (m, c) in enumerate(zip(models, compiled)):
        torch.testing.assert_close(c(x), m(x))
        assert calls[-1] == i  # each engine's forward runs the graph its own backend made
    module = [n for n in kept if n.startswith("fn")]  # the compiled module and what hangs off it
    assert any("_parameters['weight']" in n for n in module) and not any(kept[n] for n in module)
    assert kept["args[0]"]  # the input's tensor check stays
    kept.clear()
    compiled[0](x[None])  # an input of another rank fails that check: a new graph, not the old one on new shapes
    assert kept and calls[-1] == 0


def test_compiled_forward_runs_without_dynamo_after_the_same_guards():
    """compiler/direct.py: once Dynamo has compiled the forward for our backend, a call runs that code as a plain
    function after the entry's own guards. A call they refuse (another input rank) goes back to Dynamo, which
    compiles a second graph that the direct path serves from then on; a module hook (run by _call_impl, which this
    path skips) sends calls through Dynamo; another backend's compile of the same forward is never run."""
    from compiled_llm.compiler.direct import MISS, DirectForward
    from compiled_llm.compiler.model import skip_module_guards

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x, scale=None):
            y = self.proj(x).relu()
            return y if scale is None else y * scale

    class Counting:
        def __init__(self):
            self.graph_count, self.runs = 0, 0

        def __call__(self, gm, example_inputs):
            self.graph_count += 1

            def run(*args):
                self.runs += 1
                return gm(*args)
            return run

    torch.manual_seed(0)
    nets, backends = [Net(), Net()], [Counting(), Counting()]
    compiled = [torch.compile(n, backend=b, fullgraph=True, dynamic=False,
                              options={"guard_filter_fn": skip_module_guards}) for n, b in zip(nets, backends)]
    direct = [DirectForward(n, b) for n, b in zip(nets, backends)]
    x = torch.randn(3, 8)
    with torch.inference_mode():
        assert direct[0]((x,)) is MISS  # nothing compiled yet
        compiled[0](x)
        compiled[1](x)
        for d, n, b in zip(direct, nets, backends):
            runs = b.runs
            torch.testing.assert_close(d((x,)), n(x))
            assert b.runs == runs + 1 and d.calls == 1  # its own backend's code ran, without Dynamo
        assert direct[0]((x[None],)) is MISS  # another rank: the guards refuse it
        compiled[0](x[None])
        assert backends[0].graph_count == 2
        torch.testing.assert_close(direct[0]((x[None],)), nets[0](x[None]))
        assert direct[0]((x, 2.0)) is MISS  # a default argument given: compiled with scale None, refused
        compiled[0](x, 2.0)
        torch.testing.assert_close(direct[0]((x, 2.0)), nets[0](x) * 2.0)
        handle = nets[0].register_forward_hook(lambda mod, args, out: out + 1)
        assert direct[0]((x,)) is MISS
        handle.remove()
        assert direct[0]((x,)) is not MISS
