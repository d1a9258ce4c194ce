"""Qwen3.5 with images and videos against transformers' Qwen3_5(Moe)ForConditionalGeneration on tiny random
weights (fp32): prefill logprobs and greedy tokens, chunked prefill through an image, preemption, M-RoPE
positions of mixed batches, media hashes in the block hashes."""

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from multimodal_tiny import image, video_clip
from qwen3_5_tiny import IMAGE_PAD, make_qwen_vl_checkpoint
from tiny_models import hf_greedy

N = 8
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
_CKPTS: dict = {}


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    def get(name="dense_vl"):
        if name not in _CKPTS:
            folder = tmp_path_factory.mktemp(f"qwen3_5_{name}_mm")
            _CKPTS[name] = (folder, *make_qwen_vl_checkpoint(folder, name))
        return _CKPTS[name]

    return get


def make_llm(folder, **kw):
    kw.setdefault("enforce_eager", True)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 192)
    return LLM(str(folder), **kw)


def hf_run(hf, proc, text, images=(), videos=()):
    """(prompt ids, last-position logits, N greedy tokens) from transformers."""
    kw = {}
    if images:
        kw["images"] = [list(images)]
    if videos:
        kw["videos"] = list(videos)
    inputs = proc(text=[text], return_tensors="pt", **kw)
    with torch.no_grad():
        logits = hf(**inputs).logits[0, -1]
        hf.generation_config.eos_token_id = None
        out = hf.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
    return inputs["input_ids"][0].tolist(), logits, out[0, inputs["input_ids"].shape[1]:].tolist()


PARAMS = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=5)


def check(out, ref):
    ids, logits, greedy = ref
    assert out.prompt_token_ids == ids
    lp = torch.log_softmax(logits.float(), -1)
    for tok, entry in out.outputs[0].logprobs[0].items():
        assert abs(entry.logprob - lp[tok].item()) < 1e-4, (tok, entry.logprob, lp[tok].item())
    assert out.outputs[0].token_ids == greedy


def prompt(text, images=(), videos=()):
    data = {}
    if images:
        data["image"] = list(images)
    if videos:
        data["video"] = list(videos)
    return {"prompt": text, "multi_modal_data": data}


TWO = (f"The quick {IMG} brown fox {IMG} jumps", (image(1, 32, 48), image(2, 40, 24)))
_REFS: dict = {}


def two_ref(hf, proc):
    """transformers' answer to TWO (shared by the tests that use it)."""
    if id(hf) not in _REFS:
        _REFS[id(hf)] = hf_run(hf, proc, *TWO)
    return _REFS[id(hf)]


def test_image_prompt_matches_transformers(vl_ckpt):
    folder, hf, proc = vl_ckpt()
    text, images = TWO
    ref = two_ref(hf, proc)
    llm = make_llm(folder)
    check(llm.generate(prompt(text, images), PARAMS)[0], ref)
    # a text-only prompt on the same checkpoint keeps the text path (1-D positions)
    ids = llm.get_tokenizer().encode("Once upon a time")
    assert llm.generate({"prompt_token_ids": ids}, PARAMS)[0].outputs[0].token_ids == hf_greedy(hf, ids, N)


@pytest.mark.slow  # suite time: runs in `make test-slow` (25 s; the compiled text path: test_qwen3_5.py)
def test_compiled_engine_image_prompt_matches_transformers(vl_ckpt):
    """Compiled engine: the image prefill runs eager ([3, tokens] positions, merged embeddings); its decode
    steps, whose three position rows are equal, take the compiled pieces with 1-D positions."""
    folder, hf, proc = vl_ckpt()
    text, images = TWO
    llm = make_llm(folder, enforce_eager=False, cudagraph_batch_sizes="1,2", compile_sizes="none", jit_monitor="error")
    calls = []
    compiled = llm.engine.executor.runner.compiler
    llm.engine.executor.runner.compiler = lambda ids, pos: calls.append(pos.dim()) or compiled(ids, pos)
    check(llm.generate(prompt(text, images), PARAMS)[0], two_ref(hf, proc))
    assert calls and set(calls) == {1} and len(calls) >= N - 1  # every decode step compiled


def test_video_prompt_matches_transformers(vl_ckpt):
    folder, hf, proc = vl_ckpt()
    text, video = f"A tiny {VID} model", video_clip(2, frames=4)
    ref = hf_run(hf, proc, text, videos=[video])
    check(make_llm(folder).generate(prompt(text, videos=[video]), PARAMS)[0], ref)


def test_chunked_prefill_splits_images_in_a_mixed_batch(vl_ckpt):
    """An 8-token budget cuts through both images (causal vision tokens need no whole-span chunks); a
    text-only prompt in the same steps keeps its 1-D positions (repeated on the three components)."""
    folder, hf, proc = vl_ckpt()
    text, images = TWO
    ref = two_ref(hf, proc)
    ids = [5, 9, 17, 30, 41, 52]
    llm = make_llm(folder, max_num_batched_tokens=8)
    out = llm.generate([prompt(text, images), {"prompt_token_ids": ids}], PARAMS)
    check(out[0], ref)
    assert out[1].outputs[0].token_ids == hf_greedy(hf, ids, N)


def test_preemption_recomputes_mrope_positions(vl_ckpt, monkeypatch):
    """Too few blocks for five image prompts: sequences preempted after some decode steps recompute prompt
    and generated tokens (generated ones at index + delta) and still match transformers."""
    from compiled_llm.runtime.scheduler import Scheduler

    folder, hf, proc = vl_ckpt()
    cases = [(f"Once {IMG} upon", (image(i, 32, 32),)) for i in range(4)] + [TWO]
    refs = [hf_run(hf, proc, t, ims) for t, ims in cases[:4]] + [two_ref(hf, proc)]
    outputs_at_preemption = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq: (
        outputs_at_preemption.append(seq.num_output_tokens), preempt(self, seq)))
    llm = make_llm(folder, max_model_len=96, num_kv_blocks=26, max_num_batched_tokens=128)
    outs = llm.generate([prompt(t, ims) for t, ims in cases], PARAMS)
    assert max(outputs_at_preemption, default=0) > 0  # some victim had generated tokens to recompute
    for out, ref in zip(outs, refs):
        check(out, ref)


@pytest.mark.slow
def test_moe_image_prompt_matches_transformers(vl_ckpt):
    folder, hf, proc = vl_ckpt("moe_vl")
    text, images = f"Sliding {IMG} windows", (image(4, 24, 40),)
    check(make_llm(folder).generate(prompt(text, images), PARAMS)[0], hf_run(hf, proc, text, images))


def test_different_images_differ_and_share_no_blocks(vl_ckpt):
    folder, _, _ = vl_ckpt()
    llm = make_llm(folder)
    text = f"The quick brown fox jumps {IMG} over"
    a, b, a2 = (prompt(text, (image(s, 32, 32),)) for s in (1, 2, 1))
    outs = llm.generate([a, b], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=3))
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids  # same placeholders...
    assert outs[0].outputs[0].cumulative_logprob != outs[1].outputs[0].cumulative_logprob  # ...other answers
    engine, bm = llm.engine, llm.engine.block_manager
    seqs = []
    for i, p in enumerate((a, b, a2)):
        engine.add_request(f"h{i}", p, SamplingParams(max_tokens=1))
        seq = engine.requests[f"h{i}"].seqs[0]
        bm.update_hashes(seq)
        seqs.append(seq)
        engine.abort_request(f"h{i}")
    first = seqs[0].token_ids.index(IMAGE_PAD) // bm.block_size
    ha, hb, ha2 = (s.block_hashes for s in seqs)
    assert ha[:first] == hb[:first] and not set(ha[first:]) & set(hb)  # no block from the image on is shared
    assert ha == ha2  # the same image hashes alike (a prefix-cache hit where caching is on)
    assert seqs[0].mm.mrope.shape == (3, len(seqs[0].token_ids))


def test_vision_weights_load_strictly(vl_ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _, _ = vl_ckpt()
    weights = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in weights)  # transformers' layout for the tower
    model = make_llm(folder).engine.executor.runner.model
    assert model.visual is not None and model.supported_modalities() == {"image", "video"}
    for name, change in (("missing", lambda w: w.pop("model.visual.merger.linear_fc2.weight")),
                         ("unexpected", lambda w: w.update({"model.visual.bogus.weight": torch.zeros(2)}))):
        dst = tmp_path / name
        shutil.copytree(folder, dst)
        w = dict(weights)
        change(w)
        save_file(w, str(dst / "model.safetensors"))
        with pytest.raises(ValueError, match=name):
            make_llm(dst)


def test_placeholder_count_must_match_the_images(vl_ckpt):
    folder, _, _ = vl_ckpt()
    llm = make_llm(folder)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate(prompt(f"One {IMG} only", (image(1, 32, 32), image(2, 32, 32))), PARAMS)
    assert llm.generate(prompt(f"One {IMG} only", (image(1, 32, 32),)), PARAMS)[0].outputs[0].token_ids


def test_image_prompt_prefix_hit(vl_ckpt):
    """The same image prompt again hits the prefix cache past both images (block hashes carry the media
    hashes; the recurrent state comes from its snapshot) and gives the tokens of an engine without it."""
    folder, _, _ = vl_ckpt()
    text, images = TWO
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    want = make_llm(folder, enable_prefix_caching=False).generate([prompt(text, images)], params)[0]
    llm = make_llm(folder)
    first, again = (llm.generate([prompt(text, images)], params)[0] for _ in range(2))
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want.outputs[0].token_ids
    n = len(want.prompt_token_ids)
    stats = llm.engine.get_stats()
    assert stats["prefix_cache_hits"] == (n - 1) // 4 * 4 and stats["prefix_state_snapshot_hits"] == 1
