"""Qwen3.5's step without host syncs, and whole-graph decode for models with recurrent state.

The CPU cannot capture a CUDA graph, so these check what would break one: a compiled step whose ops build
device tensors from host lists (torch.tensor(..., device=...) waits for the stream on CUDA, and a capture
would freeze the values), the compiler's decision to capture a stateful model's decode whole, and the
static buffers a whole-graph replay reads the state layout from (scripts/gpu_smoke.py checks the capture)."""

import os
import traceback
from unittest import mock

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.ops.registry import OPS, Capabilities, preserved_choices, select_providers
from qwen3_5_tiny import WIDE
from tiny_models import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class DeviceTensorSpy:
    """Stands in for the runner's compiler: around each forward, counts torch.tensor calls given a device and
    .item() / .tolist() reads, and how many forwards were decode steps."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[str] = []
        self.decode_steps = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, input_ids, positions, *args, **kwargs):
        from compiled_llm.ops.context import get_forward_context

        meta = get_forward_context().attn_metadata
        self.decode_steps += len(meta.seq_lens) == meta.query_start_loc[-1]
        real_tensor, real_item, real_tolist = torch.tensor, torch.Tensor.item, torch.Tensor.tolist

        def tensor(*a, **k):
            if k.get("device") is not None:
                caller = traceback.extract_stack(limit=2)[0]
                self.calls.append(f"torch.tensor(device={k['device']}) at {caller.filename}:{caller.lineno}")
            return real_tensor(*a, **k)

        def item(t):
            self.calls.append("item")
            return real_item(t)

        def tolist(t):
            self.calls.append("tolist")
            return real_tolist(t)

        with mock.patch("torch.tensor", tensor), mock.patch.object(torch.Tensor, "item", item), \
                mock.patch.object(torch.Tensor, "tolist", tolist):
            return self.inner(input_ids, positions, *args, **kwargs)


def test_compiled_step_builds_no_device_tensor_from_the_host(qwen_ckpt):
    """The compiled Qwen3.5 forward (state ops, attention, compiled pieces) makes no torch.tensor(...,
    device=...) and reads nothing back to the host: the state layout comes built and uploaded by the runner
    once per step. Greedy tokens equal transformers' (decode steps of 1 and several sequences, padded to the
    buckets, and chunked prefill), from one Dynamo graph."""
    folder, hf = qwen_ckpt("dense")
    vocab = hf.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 13, 3)]
    llm = LLM(str(folder), enforce_eager=False, block_size=4, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=8, cudagraph_batch_sizes="1,4", compile_sizes="none", jit_monitor="error")
    runner = llm.engine.executor.runner
    spy = runner.compiler = DeviceTensorSpy(runner.compiler)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert spy.decode_steps >= 10
    assert spy.calls == []
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in ps]
    # one Dynamo graph for every token count: no view in the model guards on the count being >= 2, which a
    # one-token step (warm-up's batch 1) would fail, compiling the whole forward again
    assert spy.inner.summary()["dynamo_graphs"] == 1


@pytest.mark.parametrize("name", sorted(WIDE))
def test_stateful_models_may_capture_decode_whole(qwen_ckpt, name):
    """With the providers a GPU gets (Triton attention and state ops, declared capturable), the compiler lets
    a Qwen3.5 model capture its decode step as one graph; pipeline stages still may not, nor sparse KV without a
    capturable sparse kernel chosen (none here), nor a model whose
    state op runs on its (uncapturable) reference."""
    import json

    from compiled_llm.compiler import whole_graph_decode_ok
    from compiled_llm.models.registry import resolve_model_class
    from compiled_llm.ops.registry import model_facts

    # head_dim 32: the Triton attention kernel takes the full-attention layers (16, the other tests' size, not)
    hf_config = json.loads((qwen_ckpt(name)[0] / "config.json").read_text())
    cls = resolve_model_class(hf_config)
    cfg = cls.config_from_hf(hf_config)
    gpu = Capabilities("cuda", (9, 0), frozenset({"triton"}))
    with preserved_choices(), torch.device("meta"):
        specs = cls(cfg).attention_specs()
        select_providers("cpu", torch.bfloat16, specs, model_facts(cfg, block_size=16), caps=gpu)
        assert all(OPS[op].capturable() for op in ("causal_conv1d", "gated_delta_rule", "attention"))
        assert whole_graph_decode_ok(stateful=True)
        assert not whole_graph_decode_ok(stateful=True, sparse=True)  # no sparse layer resolved to a capturable kernel
        assert not whole_graph_decode_ok(stateful=True, pipeline=True)
        select_providers("cpu", torch.bfloat16, specs, model_facts(cfg, block_size=16), "gated_delta_rule=reference",
                         caps=gpu)
        assert not whole_graph_decode_ok(stateful=True) and whole_graph_decode_ok(stateful=False)


def test_compiled_model_turns_whole_graph_on_with_cuda_graphs():
    """CompiledModel's full_graph_ok (what the warm-up's whole-graph capture items hang on) is the decision
    above and CUDA graphs and the config; CUDA graphs faked on here (the CPU never captures)."""
    from compiled_llm.compiler.backend import CompilerConfig
    from compiled_llm.compiler.model import CompiledModel, RunState

    model = torch.nn.Linear(2, 2)
    make = lambda whole, mode="auto": CompiledModel(  # noqa: E731
        model, CompilerConfig(batch_sizes=[1], cudagraphs=True, full_graph_decode=mode), "cpu", whole_graph=whole)
    assert not make(True).full_graph_ok
    with mock.patch("compiled_llm.compiler.model.RunState", lambda cudagraphs: RunState(cudagraphs=True)):
        assert make(True).full_graph_ok
        assert not make(True, "off").full_graph_ok and not make(False).full_graph_ok


def test_static_inputs_copy_in_one_launch():
    """copy_grouped (a step's copies into the static buffers): every pair copied, and the dense pairs whose
    elements are 32-bit words (int64, int32, float32) in one torch._foreach_copy_ (one launch on CUDA) as int32
    views; a strided destination, a dtype conversion and a lone pair of another dtype copied one by one. load's
    two copies go out with stage's."""
    from compiled_llm.compiler.model import StaticBatch, copy_grouped
    from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata
    from compiled_llm.ops.upload import STEP_INPUTS_ENV

    big = torch.zeros(4, 6, dtype=torch.int32)
    pairs = [(torch.zeros(3, dtype=torch.long), torch.tensor([1, 2, -3])),
             (torch.zeros(2, dtype=torch.long), torch.tensor([4, 5 << 40])),
             (torch.zeros(5, dtype=torch.int32), torch.arange(5, dtype=torch.int32)),
             (torch.zeros(2, dtype=torch.int32), torch.tensor([7, 8])),  # int64 into int32: a conversion
             (big[:2, :3], torch.ones(2, 3, dtype=torch.int32)),  # strided destination
             (torch.zeros(2, 2), torch.tensor([[0.5, -1.25], [3.0, 1e-30]])),
             (torch.zeros(3, dtype=torch.bfloat16), torch.tensor([1.5, 2, 3], dtype=torch.bfloat16))]  # 16-bit
    with mock.patch.object(torch, "_foreach_copy_", wraps=torch._foreach_copy_) as multi:
        copy_grouped(pairs)
    assert multi.call_count == 1
    assert [(d.dtype, d.numel()) for d in multi.call_args.args[0]] == [(torch.int32, n) for n in (6, 4, 5, 4)]
    for dst, src in pairs:
        assert torch.equal(dst, src.to(dst.dtype))
    assert int(big.sum()) == 6
    with mock.patch.dict(os.environ, {STEP_INPUTS_ENV: "old"}), \
            mock.patch.object(torch, "_foreach_copy_", wraps=torch._foreach_copy_) as multi:
        copy_grouped(pairs)  # the A/B's other arm: one multi-tensor copy a dtype (the two int64 pairs)
    assert multi.call_count == 1 and [d.dtype for d in multi.call_args.args[0]] == [torch.long] * 2

    buf = StaticBatch(4, [None], "cpu", max_blocks=3)
    meta = AttentionMetadata([0, 1, 2], [5, 5], 4, {None: GroupMetadata(torch.zeros(2, 3, dtype=torch.int32),
                                                                       torch.tensor([9, 4]))})
    pending: list = []
    buf.load(torch.tensor([11, 12]), torch.tensor([5, 6]), pending)
    assert buf.ids.tolist() == [0, 0, 0, 0] and len(pending) == 2  # held for stage
    with mock.patch.object(torch, "_foreach_copy_", wraps=torch._foreach_copy_) as multi:
        buf.stage(ForwardContext(meta, {}, {}, {}), 2, True, pending)
    # ids, positions, slot mapping and the block table (the buffer's full width: dense) in one copy; seq_lens
    # and offsets converted from the host lists' int64 one by one
    assert multi.call_count == 1 and len(multi.call_args.args[0]) == 4
    assert buf.ids.tolist() == [11, 12, 0, 0] and buf.pos.tolist() == [5, 6, 0, 0]
    assert buf.slots[None].tolist() == [9, 4, -1, -1] and buf.seq_lens.tolist() == [5, 5, 0, 0]
    assert buf.qsl.tolist() == [0, 1, 2, 2, 2]


def test_whole_graph_step_copies_table_rows_and_pads_once():
    """A whole-graph decode step: block-table rows narrower than the buffer go out as one pair a row, in the
    one multi-tensor copy; the padding past the step's rows is set when the row count changes, not again for
    the same count (a launch each), and a step with more rows in between has its rows padded again."""
    from compiled_llm.compiler.model import StaticBatch
    from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata

    buf = StaticBatch(4, ["a", "b"], "cpu", max_blocks=6)
    fills = []
    real_fill = torch.Tensor.fill_

    def fill(t, v):
        fills.append(t.numel())
        return real_fill(t, v)

    def step(n: int, cols: int = 2):
        base = 100 * n
        tables = {g: torch.arange(base + k, base + k + n * cols, dtype=torch.int32).view(n, cols) for k, g in
                  enumerate("ab")}
        meta = AttentionMetadata(list(range(n + 1)), [7] * n, 4,
                                 {g: GroupMetadata(tables[g], torch.arange(n) + 10) for g in "ab"})
        meta.seq_lens_tensor = torch.full((n,), 7, dtype=torch.int32)
        meta.query_start_loc_tensor = torch.arange(n + 1, dtype=torch.int32)
        pending: list = []
        buf.load(torch.arange(n) + 1, torch.arange(n) + 20, pending)
        fills.clear()
        with mock.patch.object(torch, "_foreach_copy_", wraps=torch._foreach_copy_) as multi, \
                mock.patch.object(torch.Tensor, "fill_", fill):
            buf.stage(ForwardContext(meta, {}, {}, {}), n, True, pending)
        assert multi.call_count == 1
        for g in "ab":
            assert torch.equal(buf.tables[g][:n, :cols], tables[g])
        return len(multi.call_args.args[0]), list(fills)

    count, pads = step(3)
    assert count == 2 + 2 + 2 * 3 + 2  # ids, positions; two slot maps; 3 rows a group; lengths, offsets
    assert pads  # the first step at three rows sets the padding
    assert step(3)[1] == []  # the same rows: none set again
    step(4)
    step(3)
    assert buf.ids.tolist() == [1, 2, 3, 0] and buf.pos.tolist() == [20, 21, 22, 0]
    assert buf.slots["a"].tolist() == [10, 11, 12, -1] and buf.seq_lens.tolist() == [7, 7, 7, 0]
    assert buf.tables["b"][3].tolist() == [0] * 6 and buf.qsl.tolist() == [0, 1, 2, 3, 3]
    assert step(4, cols=6)[0] == 2 + 2 + 2 + 2  # full-width tables: one dense pair a group


def test_whole_graph_staging_pads_the_state_layout():
    """The whole-graph entry copies the step's state layout into static buffers before each replay, as it
    does token ids and block tables: padded sequences get no token (offsets repeat the last), slot 0, no
    initial state; the buffers are the same tensors every step (what the captured kernels read)."""
    from compiled_llm.compiler.model import StaticBatch
    from compiled_llm.ops.context import AttentionMetadata, ForwardContext, GroupMetadata
    from compiled_llm.ops.state import STATE_KEY, StateLayout, StateMetadata

    buf = StaticBatch(4, [None], "cpu", max_blocks=3)

    def step(slots, init):
        n = len(slots)
        meta = AttentionMetadata(list(range(n + 1)), [5] * n, 4,
                                 {None: GroupMetadata(torch.zeros(n, 2, dtype=torch.int32), torch.arange(n))})
        layout = StateLayout.build(slots, init, meta.query_start_loc, "cpu")
        ctx = ForwardContext(meta, {}, {}, {STATE_KEY: StateMetadata({}, layout, copies_before=[(1, 2)])})
        return buf.stage(ctx, n, True).extra[STATE_KEY]

    with mock.patch.object(torch, "_foreach_copy_", wraps=torch._foreach_copy_) as multi:
        first = step([3, 5], [True, False])
    # the state's three int32 buffers in the one multi-tensor copy, with the step's other dense inputs (the slot
    # map, the two block-table rows; as int32 words)
    assert multi.call_count == 1 and [d.dtype for d in multi.call_args.args[0]] == [torch.int32] * 6
    t = first.layout.tensors
    assert first.layout.decode and first.layout.max_query_len == 1 and first.layout.num_seqs == 4
    assert t["query_start_loc"].tolist() == [0, 1, 2, 2, 2]
    assert t["slots"].tolist() == [3, 5, 0, 0] and t["has_initial_state"].tolist() == [1, 0, 0, 0]
    assert first.copies_before == [(1, 2)]  # made by the runner outside the forward, never captured
    second = step([7, 1, 2], [True, True, True])
    assert all(second.layout.tensors[k] is t[k] for k in t)
    assert t["slots"].tolist() == [7, 1, 2, 0] and t["query_start_loc"].tolist() == [0, 1, 2, 3, 3]
    with pytest.raises(ValueError, match="decode"):
        StateMetadata({}, StateLayout.build([0], [False], [0, 3], "cpu")).staged(4, {})
