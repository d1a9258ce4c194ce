"""KV-cache manager: per-group pools, sliding-window release, prefix hits under load."""

import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.runtime.block_manager import BlockManager
from compiled_llm.runtime.sequence import Sequence


def _seq(tokens):
    return Sequence("r", 0, tokens, SamplingParams(), 8, 0.0)


def test_sliding_group_releases_blocks_out_of_window():
    bm = BlockManager({None: 64, 8: 64}, block_size=4, enable_prefix_caching=True)
    seq = _seq(list(range(40)))
    bm.allocate(seq, 40)
    seq.num_computed_tokens = 40
    bm.commit(seq)
    held_sliding = [b for b in seq.block_tables[8] if b >= 0]
    # the next query sits at position 40 and sees positions 33..40: blocks 8 and 9 only
    assert len(held_sliding) == 2 and seq.block_tables[8][:8] == [-1] * 8
    assert len([b for b in seq.block_tables[None] if b >= 0]) == 10
    assert bm.pools[8].num_used == 2 and bm.pools[None].num_used == 10


def test_commit_releases_only_the_blocks_that_left_the_window(monkeypatch):
    """Decode steps: each commit releases the block that just left the window (once) and reads no block
    before the last release (Sequence.released_to), not every block since the sinks; a free starts the
    look from the sinks again."""
    bm = BlockManager({None: 64, 8: 64}, block_size=4, enable_prefix_caching=False)
    seq = _seq(list(range(40)))
    bm.allocate(seq, 40)
    seq.num_computed_tokens = 40
    bm.commit(seq)
    assert seq.released_to == {8: 8} and bm.pools[8].num_used == 2

    class Counting(list):  # counts the entries commit reads
        reads = 0

        def __getitem__(self, i):
            Counting.reads += 1
            return super().__getitem__(i)

    seq.block_tables[8] = Counting(seq.block_tables[8])
    released = []
    monkeypatch.setattr(bm.pools[8], "release", lambda b, real=bm.pools[8].release: released.append(b) or real(b))
    for _ in range(12):  # 12 decode tokens: positions 40..51, three more blocks leave the window
        seq.token_ids.append(7)
        bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.commit(seq)
    assert len(released) == 3 == len(set(released)) and seq.released_to[8] == 11
    assert Counting.reads <= 6  # the three blocks that left (read, then written); from the sinks each step: 100+
    assert seq.block_tables[8][:11] == [-1] * 11 and bm.pools[8].num_used == 2
    bm.free(seq)
    assert seq.released_to == {} and bm.pools[8].num_used == 0


def test_prefix_plan_needs_window_blocks_only():
    bm = BlockManager({None: 64, 8: 64}, block_size=4, enable_prefix_caching=True)
    a = _seq(list(range(40)))
    bm.allocate(a, 40)
    a.num_computed_tokens = 40
    bm.commit(a)
    bm.free(a)
    b = _seq(list(range(40)) + [99, 98, 97])
    plan = bm.plan_prefix(b)
    assert plan.num_blocks == 10
    assert plan.tables[8][:8] == [-1] * 8 and all(x >= 0 for x in plan.tables[8][8:])
    # evict the sliding blocks near the end: the hit must shrink to where the window is still cached
    pool = bm.pools[8]
    for h in b.block_hashes[8:10]:
        blk = pool.by_hash.pop(h)
        pool.hash_of[blk] = None
    c = _seq(list(range(40)) + [99])
    assert bm.plan_prefix(c).num_blocks < 10


def test_long_generation_keeps_sliding_blocks_bounded(tiny_ckpt):
    folder, _ = tiny_ckpt("short_window")  # window 6, block 4
    llm = LLM(str(folder), enforce_eager=True, block_size=4, max_model_len=256, enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("long", {"prompt_token_ids": list(range(3, 43))}["prompt_token_ids"],
                    SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    peak_sliding, peak_full = 0, 0
    while eng.has_unfinished_requests():
        eng.step()
        peak_sliding = max(peak_sliding, eng.block_manager.pools[6].num_used)
        peak_full = max(peak_full, eng.block_manager.pools[None].num_used)
    assert peak_sliding <= 3 + 10  # window + one prefill chunk of 40 tokens at most
    assert peak_full >= 190 // 4


def test_sliding_pool_is_smaller_under_a_byte_budget(tiny_ckpt):
    folder, _ = tiny_ckpt("short_window")
    llm = LLM(str(folder), enforce_eager=True, block_size=4, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, kv_cache_memory_bytes=8 << 20)
    pools = llm.engine.block_manager.pools
    assert pools[6].num_blocks < pools[None].num_blocks
    assert pools[6].num_blocks >= 4 * 4 + 8  # every sequence's window plus one step's tokens


def test_prefix_hits_survive_many_concurrent_sessions(tiny_ckpt):
    """Multi-turn sessions run concurrently: every second turn must hit its own first turn,
    and hits must not change a single token."""
    folder, _ = tiny_ckpt("all")  # sliding window 7 next to full layers
    kw = dict(enforce_eager=True, block_size=4, max_model_len=128, max_num_seqs=16)
    cached, plain = LLM(str(folder), **kw), LLM(str(folder), enable_prefix_caching=False, **kw)
    g = torch.Generator().manual_seed(5)
    sessions = [torch.randint(3, 290, (int(n),), generator=g).tolist() for n in torch.randint(20, 40, (12,), generator=g)]
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    turn1 = cached.generate([{"prompt_token_ids": s} for s in sessions], p)
    follow = [s + o.outputs[0].token_ids + [7, 8, 9, 10, 11] for s, o in zip(sessions, turn1)]
    turn2 = cached.generate([{"prompt_token_ids": f} for f in follow], p)
    ref = plain.generate([{"prompt_token_ids": f} for f in follow], p)
    assert [o.outputs[0].token_ids for o in turn2] == [o.outputs[0].token_ids for o in ref]
    for s, o in zip(sessions, turn2):
        assert o.num_cached_tokens >= (len(s) // 4 - 1) * 4, (len(s), o.num_cached_tokens)


def _ranked(rid, n, priority, arrival):
    s = Sequence(rid, 0, list(range(1, n + 1)), SamplingParams(), 8, arrival)
    s.priority = priority
    return s


def test_priority_policy_admits_and_preempts_by_priority():
    """scheduling_policy "priority": waiting sequences in (priority, arrival) order, and out of blocks the
    lowest-priority running sequence is preempted (fcfs: the latest admitted), back to wait at its place."""
    from compiled_llm.runtime.scheduler import Scheduler

    def step(sched):
        batch = sched.schedule()
        for s in sched.advance(batch):
            s.token_ids.append(9)  # the sampled token
        return [item.seq.request_id for item in batch]

    def run(policy):
        sched = Scheduler(BlockManager({None: 5}, block_size=4, enable_prefix_caching=False), max_num_seqs=4,
                          max_num_batched_tokens=64, policy=policy)
        sched.add(_ranked("low", 8, 5, 0.0))
        steps = [step(sched)]  # low alone: 2 of 5 blocks
        sched.add(_ranked("high", 8, -1, 1.0))
        steps.append(step(sched))  # low's decode takes a 3rd block, high's prompt the last 2
        sched.add(_ranked("mid", 4, 0, 2.0))
        sched.add(_ranked("low2", 4, 5, 1.5))
        steps.append(step(sched))  # high's next token needs a block there is not
        return steps, [s.request_id for s in sched.waiting], sched.num_preemptions

    assert run("fcfs") == ([["low"], ["low", "high"], ["low"]], ["high", "mid", "low2"], 1)
    assert run("priority") == ([["low"], ["low", "high"], ["high"]], ["mid", "low", "low2"], 1)


def test_step_inputs_of_long_chunks_equal_the_per_token_ones(monkeypatch):
    """A step with a long chunk makes its token ids, positions and slot mappings in numpy (prepare_inputs); they
    equal the per-token Python ones for every mix: chunks starting inside a block, a sliding group's released
    blocks (-1) before the chunk, decode rows beside a prompt chunk, a placeholder to fill."""
    import types

    from compiled_llm.runtime import model_runner
    from compiled_llm.runtime.scheduler import ScheduledSeq

    def item(n, computed, chunk, sid):
        seq = _seq(list(range(3 * sid, 3 * sid + n)))
        seq.seq_id = sid
        seq.block_tables = {None: [7 * sid + b for b in range(n // 4 + 1)],
                            8: [-1] * (computed // 4 - 1) + [900 + b for b in range(n // 4 + 2 - computed // 4)]}
        seq.num_computed_tokens = computed
        return ScheduledSeq(seq, chunk)

    runner = types.SimpleNamespace(block_size=4, kv_groups=(None, 8))
    batch = [item(301, 300, 1, 1), item(500, 6, 130, 2), item(90, 89, 1, 3), item(70, 0, 70, 4)]
    batch[2].seq.token_ids[-1] = -1  # async scheduling's placeholder, filled from the previous step's row 5

    def inputs(vector_from: int):
        monkeypatch.setattr(model_runner, "VECTOR_CHUNK_TOKENS", vector_from)
        ids, pos, meta, rows, fill, _ = model_runner.ModelRunner.prepare_inputs(runner, batch, {3: 5}, "cpu")
        cols = [ids, pos, rows, meta.seq_lens_tensor, meta.query_start_loc_tensor, *fill]
        for g in (None, 8):
            cols += [meta.groups[g].slot_mapping, meta.groups[g].block_tables]
        return cols

    python, vector = inputs(10 ** 9), inputs(64)
    assert len(python) == len(vector) == 11
    for a, b in zip(python, vector):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert python[0].shape[0] == 1 + 130 + 1 + 70 and python[1][1:4].tolist() == [6, 7, 8]
    assert python[5].tolist() == [131] and python[6].tolist() == [5]  # the placeholder's row, its source row
    assert python[7][1:4].tolist() == [7 * 2 * 4 + 1 * 4 + 2, 7 * 2 * 4 + 1 * 4 + 3, 7 * 2 * 4 + 2 * 4]


def test_block_keys_tell_apart_tokens_order_parents_and_media():
    """A block's prefix-cache key: equal for the same tokens after the same parent, different when a token, their
    order, the parent block or the media hashes differ (ids of any size, and the -1 placeholder)."""
    from compiled_llm.runtime.block_pool import block_hash

    base = block_hash(None, [1, 23, 262143, 4])
    assert block_hash(None, [1, 23, 262143, 4]) == base and len(base) == 16
    others = [block_hash(None, [12, 3, 262143, 4]), block_hash(None, [23, 1, 262143, 4]),
              block_hash(base, [1, 23, 262143, 4]), block_hash(None, [1, 23, 262143, 4], b"img"),
              block_hash(None, [1, 23, 262143, -1])]
    assert len({base, *others}) == 6
