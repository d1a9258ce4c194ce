"""The Python API and the engine: sampling features, stops, logprobs, bad input, isolation."""

import math

import pytest
import torch

from compiled_llm import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    folder, _ = tiny_ckpt("dense")
    return LLM(str(folder), enforce_eager=True, block_size=4, max_model_len=96)


def test_string_prompt_and_token_prompt_agree(llm):
    tok = llm.get_tokenizer()
    text = "The quick brown fox"
    ids = tok.encode(text)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a, b = llm.generate([text, {"prompt_token_ids": ids}], p)
    assert a.prompt_token_ids == ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == tok.decode(a.outputs[0].token_ids, skip_special_tokens=True)
    assert a.outputs[0].finish_reason == "length" and len(a.outputs[0].token_ids) == 12


def test_n_samples_seeded_reproducible_and_distinct(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    first = llm.generate("Once upon a time", p)[0]
    second = llm.generate("Once upon a time", p)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    # a seeded request gives the same tokens whatever else runs beside it
    busy = llm.generate(["Once upon a time", "Sliding windows keep"], [p, SamplingParams(temperature=1.0,
                                                                                          max_tokens=10)])
    assert [o.token_ids for o in busy[0].outputs] == [o.token_ids for o in first.outputs]


def test_logprobs_are_log_softmax_of_the_model(llm, tiny_ckpt):
    _, hf = tiny_ckpt("dense")
    tok = llm.get_tokenizer()
    ids = tok.encode("Continuous batching")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, logprobs=4,
                                                                 ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + out.token_ids])).logits[0].float(), -1)
    for step, entry in enumerate(out.logprobs):
        row = ref[len(ids) - 1 + step]
        top = torch.topk(row, 4)
        assert out.token_ids[step] in entry
        assert entry[out.token_ids[step]].rank == 1  # greedy picks the best
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert math.isclose(entry[tid].logprob, lp, abs_tol=1e-4)
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)),
                        abs_tol=1e-5)


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(base.text) > 4
    stop = base.text[2:4]
    cut = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[:base.text.index(stop)]
    keep = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                    include_stop_str_in_output=True))[0].outputs[0]
    assert keep.text == base.text[:base.text.index(stop) + len(stop)]
    tid = base.token_ids[5]
    by_id = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tid]))[0]
    out = by_id.outputs[0]
    assert out.stop_reason == tid and out.token_ids == base.token_ids[:base.token_ids.index(tid) + 1]


def test_eos_and_min_tokens(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon")
    # make EOS the greedy choice: stop at the first generated token unless min_tokens forbids it
    eos = tok.eos_token_id
    base = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6,
                                                                  ignore_eos=True))[0].outputs[0]
    stop_at = base.token_ids[0]
    first = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6,
                                                                   stop_token_ids=[stop_at]))[0].outputs[0]
    assert first.token_ids == [stop_at]
    later = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, min_tokens=3,
                                                                   stop_token_ids=[stop_at]))[0].outputs[0]
    assert len(later.token_ids) >= 3 and stop_at not in later.token_ids[:3]
    assert eos in llm.engine.eos_token_ids


def test_max_model_len_caps_generation(llm):
    ids = list(range(5, 5 + 90))
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=50,
                                                                 ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 96 - 90 and out.finish_reason == "length"


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"), (dict(min_p=2.0), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"), (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(output_kind=RequestOutputKind.DELTA), "output_kind"), (dict(output_kind=7), "output_kind"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_the_engine_serving(llm):
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate("Once upon a time", good)[0].outputs[0].token_ids
    eng = llm.engine
    eng.add_request("other", "Once upon a time", good)  # in flight while bad requests arrive
    for bad in ["", [], list(range(200)), [10 ** 9]]:
        with pytest.raises(ValueError):
            eng.add_request("bad", bad, good)
    for named in (dict(logit_bias={10 ** 6: 1.0}), dict(allowed_token_ids=[3, 10 ** 6])):
        with pytest.raises(ValueError, match="out of the vocabulary"):
            eng.add_request("bad", "fine prompt", SamplingParams(**named))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("other", "x", good)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine prompt", {"prompt_token_ids": list(range(3, 120))}], good)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == ["other"] and outs[0].outputs[0].token_ids == ref


def test_output_kinds(llm, monkeypatch):
    """CUMULATIVE (the engine's default): an output each time the request gains a token, all its tokens so far;
    FINAL_ONLY: one output, when it ends, equal to the cumulative one's last. LLM.generate asks FINAL_ONLY (one
    output built a request, not one a step with a copy of the growing output) and leaves the caller's params as
    they were."""
    eng = llm.engine
    kw = dict(temperature=0, max_tokens=10, ignore_eos=True)
    eng.add_request("cum", "Once upon a time", SamplingParams(**kw))
    eng.add_request("fin", "Once upon a time", SamplingParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY))
    seen = {"cum": [], "fin": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen[o.request_id].append(o)
    assert [len(o.outputs[0].token_ids) for o in seen["cum"]] == list(range(1, 11))
    (fin,) = seen["fin"]
    last = seen["cum"][-1].outputs[0]
    assert fin.finished and (fin.outputs[0].token_ids, fin.outputs[0].text) == (last.token_ids, last.text)
    built, real = [], eng.output_processor.output
    monkeypatch.setattr(eng.output_processor, "output", lambda req: built.append(req.request_id) or real(req))
    params = SamplingParams(**kw)
    outs = llm.generate(["Once upon a time", "The quick brown fox"], params)
    assert len(built) == 2 and params.output_kind == RequestOutputKind.CUMULATIVE
    assert outs[0].outputs[0].token_ids == last.token_ids and len(outs[1].outputs[0].token_ids) == 10


def test_abort_frees_blocks(llm):
    eng = llm.engine
    free = eng.get_stats()["num_free_blocks"]
    eng.add_request("a", "Once upon a time there was", SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.get_stats()["num_free_blocks"] < free
    out = eng.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.get_stats()["num_free_blocks"] == free and not eng.has_unfinished_requests()


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "hello"}]
    text = llm.engine.apply_chat_template(msgs)
    assert text.startswith("<bos><user>hello") and text.endswith("<model>")
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="empty"):
        llm.chat([])


def test_truncate_prompt_tokens(llm):
    """vLLM's truncate_prompt_tokens: the prompt's start is cut and the model sees (and answers) its last N tokens
    only, exactly as if given them; -1 keeps max_model_len - 1 (room for one token)."""
    ids = list(range(10, 40))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                   truncate_prompt_tokens=7))[0]
    assert cut.prompt_token_ids == ids[-7:]
    assert cut.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids[-7:]}, params)[0].outputs[0].token_ids
    long = list(range(5, 5 + 150)) * 1  # past max_model_len (96)
    out = llm.generate({"prompt_token_ids": long}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == long[-95:] and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="below max_model_len"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=96))
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert not llm.engine.has_unfinished_requests()


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_bad_words(llm):
    """vLLM's bad_words: a word the free greedy output writes never appears once banned (neither as written nor
    after a space); the first tokens before it are the free ones."""
    tok, proc = llm.get_tokenizer(), llm.engine.input_processor
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate("The quick brown fox", params)[0].outputs[0].token_ids
    # a generated token that is a word of its own (its text encodes back to it), past the first position
    k, word = next((k, tok.decode([t]).strip()) for k, t in enumerate(free) if k > 0 and tok.decode([t]).strip()
                   and any(ids == [t] for ids in proc.bad_words_token_ids([tok.decode([t]).strip()])))
    banned = proc.bad_words_token_ids([word])
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             bad_words=[word]))[0].outputs[0].token_ids
    assert _contains(free, [free[k]]) and not any(_contains(out, ids) for ids in banned)
    first = next(i for i, t in enumerate(free) if any(ids == [t] for ids in banned))
    assert out[:first] == free[:first] and out != free


def test_chat_continues_the_final_message(llm):
    """continue_final_message (vLLM's, transformers'): an answer begun by the caller is left open, without its end
    of turn, and the model's tokens go on from it."""
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Sure, the answer is"}]
    closed = llm.engine.apply_chat_template(msgs, add_generation_prompt=False)
    open_ = llm.engine.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert open_.endswith("Sure, the answer is") and closed.startswith(open_) and len(closed) > len(open_)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.chat(msgs, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode(open_, add_special_tokens=False)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(msgs, params, continue_final_message=True)


def test_input_processor_copy_is_independent(llm):
    """The server's input processor (another thread) renders and tokenizes as the engine does, with a
    tokenizer of its own; a text-only model has no media placeholders."""
    mine = llm.engine.new_input_processor()
    assert mine.tokenizer is not llm.engine.tokenizer
    msgs = [{"role": "user", "content": "hello"}]
    text = mine.apply_chat_template(msgs)
    assert text == llm.engine.apply_chat_template(msgs)
    assert mine.tokenize(text, add_special_tokens=False) == llm.engine.tokenize(text, add_special_tokens=False)
    assert mine.media_placeholders() == {}
    with pytest.raises(ValueError, match="role"):
        mine.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_unknown_architecture_and_missing_weights(tmp_path, tiny_ckpt):
    import json
    import shutil

    folder, _ = tiny_ckpt("dense")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FancyNewModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*Gemma4ForCausalLM"):
        LLM(str(bad))
    nowts = tmp_path / "noweights"
    shutil.copytree(folder, nowts)
    (nowts / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(nowts))


def test_startup_heap_freeze_switch(monkeypatch):
    """An engine moves start-up's objects out of the collector's way (gc.freeze; H200: a 1K prompt's
    collections 28.7 -> 0.7 ms over 15 runs); COMPILED_LLM_GC_FREEZE=0 leaves the heap alone (the suite does)."""
    import gc

    from compiled_llm.runtime import heap

    gc.unfreeze()
    try:
        monkeypatch.setenv(heap.GC_FREEZE_ENV, "0")
        heap.freeze_startup_heap()
        assert gc.get_freeze_count() == 0
        monkeypatch.setenv(heap.GC_FREEZE_ENV, "1")
        heap.freeze_startup_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("kind, eager", [("gemma", False), ("qwen", True)])
def test_a_deleted_engine_frees_its_weights_and_cache(kind, eager, tiny_ckpt, qwen_ckpt, monkeypatch):
    """Deleting an LLM after it served frees every parameter, buffer and KV-cache tensor it held, so a process
    can build another engine in the memory of the first (a notebook, a sweep). The engine freezes start-up's heap
    (gc.freeze), so nothing it built may need the cycle collector to go: the embedding, each row-parallel
    projection and the experts had held their layer's loader method (parameter -> method -> layer ->
    parameter), and 30 of the tiny MoE's 164 tensors outlived their engine; on a GPU the experts are most of a
    model's memory."""
    import gc
    import weakref

    from compiled_llm.runtime import heap

    monkeypatch.setenv(heap.GC_FREEZE_ENV, "1")  # as a user's process runs (the suite turns it off)
    folder, _ = tiny_ckpt("moe") if kind == "gemma" else qwen_ckpt("moe")
    try:
        llm = LLM(str(folder), enforce_eager=eager, block_size=4, max_model_len=64)
        assert gc.get_freeze_count() > 0
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3
        runner = llm.engine.executor.runner
        tensors = [*runner.model.named_parameters(), *runner.model.named_buffers(),
                   *(("kv cache", t) for t in runner.kv_caches.values())]
        assert any("experts" in name for name, _ in tensors)
        refs = [(name, weakref.ref(t)) for name, t in tensors]
        del llm, runner, tensors, out
        gc.collect()
        assert [name for name, ref in refs if ref() is not None] == []
    finally:
        gc.unfreeze()


def test_a_cpu_engine_stepped_off_its_builder_thread_warns_once(tiny_ckpt, caplog):
    """On the CPU an engine stepped on a thread other than the one that built it runs several times slower
    (OpenMP's thread teams exceed the cores): a warning says so once, and says nothing on the builder thread or
    when torch runs one thread."""
    import logging
    import threading

    folder, _ = tiny_ckpt("dense")
    params = SamplingParams(max_tokens=2, temperature=0)

    def run_on_another_thread(llm):
        thread = threading.Thread(target=llm.generate, args=([[5, 6, 7]], params))
        thread.start()
        thread.join()

    warned = lambda: [r for r in caplog.records if "stepped on another" in r.getMessage()]  # noqa: E731
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.WARNING, logger="compiled_llm"):
            llm = LLM(str(folder), enforce_eager=True, block_size=4, max_model_len=32)
            llm.generate([[5, 6, 7]], params)
            run_on_another_thread(llm)  # the first step's thread is the one checked
            assert warned() == []
            llm.engine._builder_thread = threading.get_ident()  # as if built here: check the next step again
            run_on_another_thread(llm)
            run_on_another_thread(llm)
            assert len(warned()) == 1
            torch.set_num_threads(1)
            llm.engine._builder_thread = threading.get_ident()
            run_on_another_thread(llm)  # a thread started now runs one OpenMP thread: nothing to say
            assert len(warned()) == 1
    finally:
        torch.set_num_threads(1)


def test_priority_scheduling(tiny_ckpt, llm):
    """--scheduling-policy priority: with one sequence at a time, requests run lowest priority value first
    (arrival breaks ties); under fcfs a priority other than 0 is refused."""
    folder, _ = tiny_ckpt("dense")
    prio = LLM(str(folder), enforce_eager=True, block_size=4, max_model_len=96, max_num_seqs=1,
               scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = prio.generate(["a b c", "d e f", "g h i", "j k l"], params, priority=[5, 0, -1, 0])
    started = [o.metrics.first_token_time for o in outs]
    assert sorted(range(4), key=started.__getitem__) == [2, 1, 3, 0]
    for o in outs:  # each request's phases, in order (the server's request_*_time_seconds histograms read them)
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time == m.finished_time
    # one sequence at a time: each request is first scheduled after the one before it finished
    order = [outs[i].metrics for i in (2, 1, 3, 0)]
    assert all(b.first_scheduled_time >= a.finished_time for a, b in zip(order, order[1:]))
    with pytest.raises(ValueError, match="scheduling policy"):
        llm.generate("x", params, priority=[1])
