"""Our Gemma 4 against transformers' on the same random weights: logits and greedy tokens."""

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from tiny_models import CONFIGS, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def prompts(vocab: int, lengths=(5, 17, 30), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def make_llm(folder, **kw):
    kw.setdefault("enforce_eager", True)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    return LLM(str(folder), **kw)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_match(tiny_ckpt, name):
    folder, hf = tiny_ckpt(name)
    llm = make_llm(folder)
    runner = llm.engine.executor.runner
    ids = prompts(hf.config.vocab_size, (23,))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # run the prompt through our runner and keep every position's logits
    from compiled_llm.runtime.scheduler import ScheduledSeq
    from compiled_llm.runtime.sequence import Sequence
    seq = Sequence("x", 0, ids, GREEDY, 1, 0.0)
    llm.engine.block_manager.allocate(seq, len(ids))
    input_ids, positions, meta, _, _ = runner.prepare([ScheduledSeq(seq, len(ids))])
    from compiled_llm.ops.context import ForwardContext, set_forward_context
    with torch.no_grad(), set_forward_context(ForwardContext(meta, runner.kv_caches, runner.specs)):
        ours = runner.model.compute_logits(runner.model(input_ids, positions))
    llm.engine.block_manager.free(seq)
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"{name}: max abs diff {err}"


@pytest.fixture(scope="module")
def hf_reference(tiny_ckpt):
    cache = {}

    def get(name):
        if name not in cache:
            folder, hf = tiny_ckpt(name)
            ps = prompts(hf.config.vocab_size)
            cache[name] = (ps, [hf_greedy(hf, p, 32) for p in ps])
        return cache[name]

    return get


def generate_ids(llm, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers_batched(tiny_ckpt, hf_reference, name):
    folder, _ = tiny_ckpt(name)
    ps, ref = hf_reference(name)
    assert generate_ids(make_llm(folder), ps) == ref


@pytest.mark.parametrize("name", ["all", "short_window", "k_eq_v"])
def test_greedy_one_at_a_time_and_chunked(tiny_ckpt, hf_reference, name):
    folder, _ = tiny_ckpt(name)
    ps, ref = hf_reference(name)
    llm = make_llm(folder, max_num_batched_tokens=7)  # prompts are prefilled in chunks of <= 7 tokens
    assert [generate_ids(llm, [p])[0] for p in ps] == ref
    assert generate_ids(llm, ps) == ref


@pytest.mark.parametrize("name", ["all", "short_window", "dense"])
def test_greedy_under_preemption(tiny_ckpt, hf_reference, name):
    folder, _ = tiny_ckpt(name)
    ps, ref = hf_reference(name)
    llm = make_llm(folder, num_kv_blocks=20, max_model_len=64)  # 80 tokens: the batch cannot fit at once
    assert generate_ids(llm, ps) == ref
    assert llm.engine.get_stats()["num_preemptions"] > 0


@pytest.mark.parametrize("name", ["all", "short_window"])
def test_prefix_cache_hits_keep_tokens(tiny_ckpt, hf_reference, name):
    folder, _ = tiny_ckpt(name)
    ps, ref = hf_reference(name)
    llm = make_llm(folder)
    first = generate_ids(llm, ps)
    before = llm.engine.get_stats()["prefix_cache_hits"]
    second = generate_ids(llm, ps)
    stats = llm.engine.get_stats()
    assert first == ref and second == ref
    assert stats["prefix_cache_hits"] - before >= 4 * (len(ps[1]) // 4 - 2)


def test_prefix_cache_off_counts_no_hits(tiny_ckpt):
    folder, hf = tiny_ckpt("dense")
    llm = make_llm(folder, enable_prefix_caching=False)
    ps = prompts(hf.config.vocab_size)
    generate_ids(llm, ps)
    generate_ids(llm, ps)
    assert llm.engine.get_stats()["prefix_cache_hits"] == 0


def test_k_eq_v_rows_keep_rotated_keys(tiny_ckpt, hf_reference, monkeypatch):
    """K=V global layers whose keys rotate in a quarter of each half keep those keys beside each cached value
    (AttentionSpec.rot_keys, written at the token's position); the ops see the value part, a view. The rows
    hold exactly the keys rebuilt from the values, and the tokens match transformers with and without them."""
    from compiled_llm.ops.attention import cache_rows, keys_from_values
    from compiled_llm.runtime.kv_plan import ROT_KEYS_ENV

    folder, _ = tiny_ckpt("k_eq_v")
    ps, ref = hf_reference("k_eq_v")
    llm = make_llm(folder, enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    full = [i for i, s in runner.specs.items() if s.k_eq_v]
    assert full and all(runner.specs[i].rot_keys == 16 and runner.specs[i].cache_dim == 96 for i in full)
    assert all(runner.specs[i].rot_keys == 0 for i in runner.specs if i not in full)
    bytes_k_eq_v = runner.group_block_bytes()[None]
    assert generate_ids(llm, ps[1:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    # one sequence's rows after its prompt and 8 tokens: the cached keys are the rebuilt ones, bit for bit
    spec = runner.specs[full[0]]
    cache = runner.kv_caches[full[0]]
    assert cache.shape[-1] == 64 and cache.stride(-2) == 96
    rows = cache_rows(cache, spec).reshape(-1, spec.num_kv_heads, 96)
    n = len(ps[1]) + 7  # the last token's KV is never written
    written = (rows[:, :, :64].abs().sum((1, 2)) > 0).nonzero().flatten()
    assert len(written) == n
    slots = written.sort().values  # one sequence in order: block ids rise with its positions here
    keys = keys_from_values(rows[slots, :, :64], torch.arange(n), spec)
    assert torch.equal(rows[slots, :, 64:80], keys[..., :16]) and torch.equal(rows[slots, :, 80:], keys[..., 32:48])
    assert generate_ids(llm, ps) == ref
    off = make_llm(folder, kv_rotated_keys=False)  # the engine option (--no-kv-rotated-keys)
    assert all(s.rot_keys == 0 for s in off.engine.executor.runner.specs.values())
    assert off.engine.executor.runner.group_block_bytes()[None] * 96 == bytes_k_eq_v * 64
    assert generate_ids(off, ps) == ref
    monkeypatch.setenv(ROT_KEYS_ENV, "0")  # the A/B switch of the benchmarks
    assert all(s.rot_keys == 0 for s in make_llm(folder).engine.executor.runner.specs.values())
