"""Prefix caching for hybrid models (Qwen3.5: Gated DeltaNet + attention) on tiny random checkpoints: a prefix
hit restores the recurrent and conv state from a snapshot taken at a block boundary, so only the tokens past
it are computed; greedy tokens equal those of the same engine without prefix caching."""

import pytest
import torch

from compiled_llm import LLM, SamplingParams

BS = 4


@pytest.fixture(scope="module")
def ckpt(qwen_ckpt):
    """ckpt(name) -> (folder, vocabulary size) of the session's tiny Qwen3.5 checkpoint."""
    def get(name):
        folder, hf = qwen_ckpt(name)
        return folder, hf.config.get_text_config().vocab_size

    return get


def make_llm(folder, **kw):
    kw.setdefault("enforce_eager", True)
    kw.setdefault("block_size", BS)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("num_kv_blocks", 128)  # small and quick to set up
    return LLM(str(folder), **kw)


def toks(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm, prompt: list[int], n: int = 6) -> tuple[list[int], int, int]:
    """One request alone: its tokens, the prompt tokens computed for it and its prefix-cache hits."""
    before = llm.engine.get_stats()
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(n))[0].outputs[0].token_ids
    after = llm.engine.get_stats()
    return (list(out), after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
            after["prefix_cache_hits"] - before["prefix_cache_hits"])


def test_shared_prefix_skips_the_prefix(ckpt):
    """Three prompts over one 40-token prefix. The first keeps a snapshot at its last full prompt block; the
    second finds the prefix's KV cached but no snapshot at its end, so it computes everything and leaves one
    there (its prefill is cut at the branch point); the third computes only its own tokens. The first
    prompt again computes one token."""
    folder, vocab = ckpt("dense")
    cached, plain = make_llm(folder, prefix_state_snapshots=8), make_llm(folder, enable_prefix_caching=False)
    prefix = toks(vocab, 40, 1)
    ps = [prefix + toks(vocab, k, 10 + k) for k in (5, 6, 7)]
    got = [run(cached, p) for p in ps + [ps[0]]]
    want = [run(plain, p) for p in ps + [ps[0]]]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got] == [45, 46, 7, 1]
    assert [g[2] for g in got] == [0, 0, 40, 44]
    stats = cached.engine.get_stats()
    assert stats["prefix_state_snapshot_hits"] == 2 and stats["prefix_state_snapshots"] > 0
    assert stats["prefix_state_snapshot_slots"] == 8
    assert len(cached.engine.block_manager.free_state_slots) == 4


@pytest.mark.parametrize("name,async_", [("dense", False), ("moe", False), ("dense", True)])
def test_second_chat_turn_computes_only_new_tokens(ckpt, name, async_):
    """Turn 2 = turn 1's prompt + its answer + new text: the state snapshot a decode step left at the last
    block boundary of turn 1 serves the whole history it computed (42 prompt + 7 generated tokens, of which
    48 computed: the last sampled token never is), so turn 2 computes that last token and the new text."""
    folder, vocab = ckpt(name)
    # async_: under async scheduling the decode step that takes the snapshot reads a token still on its way
    cached, plain = make_llm(folder, async_scheduling=async_), make_llm(folder, enable_prefix_caching=False)
    assert cached.engine.async_scheduling is async_
    turn1 = toks(vocab, 42, 2)
    ans, computed, _ = run(cached, turn1, 7)
    assert computed == 42 and ans == run(plain, turn1, 7)[0]
    new = toks(vocab, 9, 3)
    turn2 = turn1 + ans + new
    ans2, computed, hits = run(cached, turn2, 8)
    assert ans2 == run(plain, turn2, 8)[0]
    assert (computed, hits) == (1 + len(new), 48)
    assert cached.engine.get_stats()["prefix_state_snapshot_slots"] == 4  # default: max_num_seqs
    # turn 3 after a history that does not end on a block boundary: at most BS - 1 of it is computed again
    turn3 = turn2 + ans2 + toks(vocab, 5, 4)
    ans3, computed, hits = run(cached, turn3, 4)
    assert ans3 == run(plain, turn3, 4)[0]
    assert hits == (len(turn2) + len(ans2) - 1) // BS * BS and computed == len(turn3) - hits


def test_evicted_snapshots_and_blocks_are_not_used(ckpt):
    """A snapshot pushed out of its pool (2 slots) leaves the prefix's KV without a usable hit; KV blocks
    evicted from a small cache drop their snapshots. Tokens stay right either way."""
    folder, vocab = ckpt("dense")
    plain = make_llm(folder, enable_prefix_caching=False)
    ps = [toks(vocab, 30, 20 + i) for i in range(4)]
    want = {i: run(plain, p)[0] for i, p in enumerate(ps)}

    few = make_llm(folder, prefix_state_snapshots=2)
    assert run(few, ps[0]) == (want[0], 30, 0)
    assert run(few, ps[0])[1:] == (2, 28)  # its snapshot at 28 (the last full block before its last token)
    for i in (1, 2):  # two more prompts' snapshots push it out
        assert run(few, ps[i])[0] == want[i]
    bm = few.engine.block_manager
    assert len(bm.snapshots) == 2 and bm.update_hashes(few_seq := _seq(ps[0])) is None
    assert few_seq.block_hashes[6] in bm.pools[None].by_hash  # its KV is still cached ...
    assert run(few, ps[0]) == (want[0], 30, 0)  # ... but without a snapshot it is no hit

    small = make_llm(folder, num_kv_blocks=20, max_model_len=64)  # 80 tokens of KV: each prompt evicts the last
    assert run(small, ps[0]) == (want[0], 30, 0)
    for i in (1, 2, 3):
        assert run(small, ps[i])[0] == want[i]
    bm = small.engine.block_manager
    seq = _seq(ps[0])
    bm.update_hashes(seq)
    assert all(h not in bm.snapshots for h in seq.block_hashes)  # dropped with their blocks
    assert run(small, ps[0]) == (want[0], 30, 0)


def _seq(prompt):
    from compiled_llm.runtime.sequence import Sequence

    return Sequence("x", 0, prompt, greedy(1), 1, 0.0)


@pytest.mark.parametrize("budget,async_", [(7, False), (2048, False), (7, True)])
def test_batched_chunked_and_preempted_requests_match(ckpt, budget, async_):
    """Requests sharing a prefix, all at once, under chunked prefill (7-token steps; also under async
    scheduling) or preemption (a small cache): the same tokens as without prefix caching, and every state
    slot comes back."""
    folder, vocab = ckpt("dense")
    prefix = toks(vocab, 26, 5)
    ps = [prefix + toks(vocab, k, 30 + k) for k in (3, 5, 9)] + [prefix + toks(vocab, 3, 33)]
    kw = dict(max_num_batched_tokens=budget, num_kv_blocks=24 if budget > 7 else 128, max_model_len=64)
    params = greedy(10)
    outs = {}
    for on in (True, False):
        llm = make_llm(folder, enable_prefix_caching=on, async_scheduling=async_, **kw)
        first = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
        second = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
        outs[on] = (first, second, llm.engine.get_stats())
        assert len(llm.engine.block_manager.free_state_slots) == 4
    assert outs[True][:2] == outs[False][:2]
    assert outs[True][0] == outs[True][1]
    stats = outs[True][2]
    assert stats["prefix_cache_hits"] > 0 and stats["prompt_tokens_computed"] < outs[False][2]["prompt_tokens_computed"]
    if budget > 7:
        assert stats["num_preemptions"] > 0


@pytest.mark.slow  # suite time: runs in `make test-slow` (15 s)
def test_compiled_prefix_hit(ckpt):
    """The compiled path: a prefix hit and a chat turn give the eager engine's tokens."""
    folder, vocab = ckpt("dense")
    eager = make_llm(folder, enable_prefix_caching=False)
    llm = make_llm(folder, enforce_eager=False, cudagraph_batch_sizes="1,2,4", jit_monitor="error")
    p = toks(vocab, 33, 7)
    ans = run(llm, p)[0]
    assert ans == run(eager, p)[0]
    turn2 = p + ans + toks(vocab, 4, 8)
    got, computed, hits = run(llm, turn2)
    assert got == run(eager, turn2)[0] and hits == 36 and computed == len(turn2) - 36


def test_snapshot_pool_policy():
    """The block manager alone: a prompt snapshot at its last full block before the last token; a sequence's
    tail snapshots reuse one slot; a tail pushes out only tails; a hit needs the snapshot and the blocks."""
    from compiled_llm.runtime.block_manager import BlockManager

    bm = BlockManager({None: 64}, BS, True, num_state_slots=4, num_snapshot_slots=2)
    assert bm.free_state_slots == [1, 0] and sorted(bm.free_snapshot_slots) == [2, 3]

    def step(seq, n):
        bm.allocate(seq, n, bm.plan_prefix(seq) if seq.state_slot is None else None)
        slot = bm.reserve_snapshot(seq, n)
        seq.num_computed_tokens += n
        bm.commit(seq)
        return slot

    a = _seq(list(range(3, 13)))  # 10 tokens: snapshot at 8
    assert step(a, 8) is not None and step(a, 2) is None
    a.token_ids += [20, 21]  # decode: token 10 computed (ends at 11), then token 11 (ends at 12: a tail)
    assert step(a, 1) is None
    first_tail = step(a, 1)
    assert first_tail is not None and len(bm.snapshots) == 2 and a.tail_snapshot[1] == first_tail
    a.token_ids += [22, 23, 24, 25]
    for _ in range(4):
        step(a, 1)
    assert a.tail_snapshot[1] == first_tail and len(bm.snapshots) == 2  # the next tail, in the same slot
    c = _seq(list(range(3, 13)) + [7])  # a's prompt and more: hits a's prompt snapshot at 8
    plan = bm.plan_prefix(c)
    assert (plan.num_blocks, plan.state_from) == (2, bm.snapshots[a.block_hashes[1]])
    b = _seq(list(range(40, 48)))  # 8 tokens: a prompt snapshot at 4, then its whole prompt ends a block (a tail)
    assert step(b, 4) is not None  # pushes out the least recently used: a's prompt snapshot
    assert a.block_hashes[1] not in bm.snapshots and bm.plan_prefix(c).num_blocks == 0
    assert step(b, 4) == first_tail  # b's tail pushes out a's
    assert a.tail_snapshot[0] not in bm.snapshots and b.tail_snapshot[1] == first_tail
    bm.free(a), bm.free(b)  # finished: their snapshots stay
    d, e = _seq(list(range(50, 60))), _seq(list(range(60, 70)))
    assert step(d, 8) is not None and step(e, 8) is not None  # two prompt snapshots fill the pool
    assert set(bm.snapshots) == {d.block_hashes[1], e.block_hashes[1]}
    step(e, 2)
    e.token_ids += [1, 2]
    assert step(e, 1) is None and step(e, 1) is None  # a tail at 12 finds no tail to push out
    assert set(bm.snapshots) == {d.block_hashes[1], e.block_hashes[1]}
    bm.free(d), bm.free(e)
    assert sorted(bm.free_state_slots) == [0, 1] and not bm.free_snapshot_slots
