"""Gemma 4 with media (image, video, audio) against transformers' Gemma4ForConditionalGeneration, and
media hashes in the prefix cache."""

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from multimodal_tiny import audio_clip, image, make_mm_checkpoint, video_clip

N = 8


@pytest.fixture(scope="module")
def mm_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4_mm")
    hf, proc = make_mm_checkpoint(folder)
    return folder, hf, proc


@pytest.fixture(scope="module")
def mm_llm(mm_ckpt):
    folder, _, _ = mm_ckpt
    return LLM(str(folder), enforce_eager=True, max_model_len=320, block_size=8)


def hf_run(hf, proc, text, **media):
    inputs = proc(text=[text], return_tensors="pt", **{k: [v] if k != "images" else [[v]] for k, v in media.items()})
    with torch.no_grad():
        logits = hf(**inputs).logits[0, -1]
        hf.generation_config.eos_token_id = None
        out = hf.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
    return inputs["input_ids"][0].tolist(), logits, out[0, inputs["input_ids"].shape[1]:].tolist()


def check(llm, ids, logits, greedy, prompt):
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=5))[0]
    assert out.prompt_token_ids == ids
    lp = torch.log_softmax(logits.float(), -1)
    first = out.outputs[0].logprobs[0]
    for tok, entry in first.items():
        assert abs(entry.logprob - lp[tok].item()) < 1e-4, (tok, entry.logprob, lp[tok].item())
    assert out.outputs[0].token_ids == greedy
    return out


def test_image_prompt_matches_transformers(mm_ckpt, mm_llm):
    _, hf, proc = mm_ckpt
    text = "The quick <|image|> brown fox"
    ids, logits, greedy = hf_run(hf, proc, text, images=image(1))
    check(mm_llm, ids, logits, greedy, {"prompt": text, "multi_modal_data": {"image": image(1)}})


def test_video_prompt_matches_transformers(mm_ckpt, mm_llm):
    _, hf, proc = mm_ckpt
    text = "A tiny <|video|> model"
    ids, logits, greedy = hf_run(hf, proc, text, videos=video_clip(2))
    check(mm_llm, ids, logits, greedy, {"prompt": text, "multi_modal_data": {"video": video_clip(2)}})


def test_audio_prompt_matches_transformers(mm_ckpt, mm_llm):
    _, hf, proc = mm_ckpt
    text = "Once upon <|audio|> a time"
    ids, logits, greedy = hf_run(hf, proc, text, audio=audio_clip(3))
    check(mm_llm, ids, logits, greedy, {"prompt": text, "multi_modal_data": {"audio": audio_clip(3)}})


GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
TEXT = "The quick brown fox <|image|> jumps over the lazy dog"


def test_different_images_share_no_blocks_and_same_image_hits(mm_ckpt):
    folder, _, _ = mm_ckpt
    llm = LLM(str(folder), enforce_eager=True, max_model_len=320, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=3)
    a = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image(1)}}, params)[0]
    b = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image(2)}}, params)[0]
    assert a.prompt_token_ids == b.prompt_token_ids  # same placeholders...
    assert a.outputs[0].cumulative_logprob != b.outputs[0].cumulative_logprob  # ...different images, answers
    first_media = a.prompt_token_ids.index(4)
    assert b.num_cached_tokens <= first_media  # only the text before the image may come from the cache
    again = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image(1)}}, params)[0]
    assert again.num_cached_tokens > a.prompt_token_ids.index(8)  # past the image's last token
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert abs(again.outputs[0].cumulative_logprob - a.outputs[0].cumulative_logprob) < 1e-4


def test_block_hashes_carry_media_hash(mm_ckpt):
    from compiled_llm.multimodal.inputs import MediaItem, MultiModalInputs
    from compiled_llm.runtime.block_manager import BlockManager
    from compiled_llm.runtime.sequence import Sequence

    ids = [2, 3, 3, 7] + [4] * 6 + [8, 3]  # block 0: text; blocks 1 and 2: the image
    seqs = []
    for h in (b"a" * 16, b"b" * 16):
        s = Sequence("r", 0, ids, GREEDY, 4, 0.0)
        s.mm = MultiModalInputs([MediaItem("image", {}, torch.arange(4, 10), h)], [(4, 10)])
        BlockManager({None: 8}, 4, True).update_hashes(s)
        seqs.append(s)
    plain = Sequence("r", 0, ids, GREEDY, 4, 0.0)
    BlockManager({None: 8}, 4, True).update_hashes(plain)
    assert seqs[0].block_hashes[0] == seqs[1].block_hashes[0] == plain.block_hashes[0]  # text-only block
    for b in (1, 2):
        assert len({seqs[0].block_hashes[b], seqs[1].block_hashes[b], plain.block_hashes[b]}) == 3


def test_chunked_prefill_keeps_an_image_in_one_chunk(mm_ckpt, mm_llm):
    folder, _, _ = mm_ckpt
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": image(1)}}
    ref = mm_llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    llm = LLM(str(folder), enforce_eager=True, max_model_len=320, block_size=4, max_num_batched_tokens=70,
              enable_prefix_caching=False)
    out = llm.generate([prompt, {"prompt": "Once upon a time", "multi_modal_data": {}}], GREEDY)
    assert out[0].outputs[0].token_ids == ref
    small = LLM(str(folder), enforce_eager=True, max_model_len=320, block_size=4, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="one step"):
        small.generate(prompt, GREEDY)
    assert small.generate("Once upon a time", GREEDY)[0].outputs[0].token_ids


def test_bad_multimodal_prompts_are_refused(mm_ckpt, mm_llm):
    with pytest.raises(ValueError, match="placeholder"):
        mm_llm.generate({"prompt": "no placeholder here", "multi_modal_data": {"audio": [audio_clip(1)]}}, GREEDY)
    with pytest.raises(ValueError, match="unknown modality"):
        mm_llm.generate({"prompt": "x <|image|>", "multi_modal_data": {"pointcloud": [1]}}, GREEDY)
    assert mm_llm.generate("Once upon a time", GREEDY)[0].outputs[0].token_ids


def test_text_only_checkpoint_refuses_media(tiny_ckpt):
    folder, _ = tiny_ckpt("dense")
    llm = LLM(str(folder), enforce_eager=True, max_model_len=64)
    with pytest.raises(ValueError, match="does not take image"):
        llm.generate({"prompt": "a <img>", "multi_modal_data": {"image": image(1)}}, GREEDY)


def test_clamp_chunk_never_splits_a_span():
    from compiled_llm.multimodal.inputs import MultiModalInputs

    mm = MultiModalInputs([], [(10, 20), (30, 35)])
    assert mm.clamp_chunk(0, 8) == 8  # before any span
    assert mm.clamp_chunk(0, 15) == 10  # would end inside (10, 20): stop before it
    assert mm.clamp_chunk(0, 20) == 20  # ends right after it
    assert mm.clamp_chunk(10, 5) == 0  # starts at a span that does not fit: wait
    assert mm.clamp_chunk(12, 5) == 0  # starts inside (after a prefix hit) and does not reach its end
    assert mm.clamp_chunk(12, 8) == 8
    assert mm.clamp_chunk(20, 12) == 10  # (30, 35) cut: stop at 30


def test_text_only_requests_never_touch_the_media_path(mm_llm, monkeypatch):
    import compiled_llm.runtime.model_runner as mr

    def boom(*_):
        raise AssertionError("a text-only step went through the media path")

    monkeypatch.setattr(mr, "prepare_media", boom)
    assert len(mm_llm.generate(["Once upon a time", {"prompt_token_ids": [2, 5, 9]}], GREEDY)) == 2


def test_preempted_media_prompt_recomputes_the_same(mm_ckpt, mm_llm):
    folder, _, _ = mm_ckpt
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt": TEXT, "multi_modal_data": {"image": image(i)}} for i in (1, 2)]
    ref = [o.outputs[0].token_ids for o in mm_llm.generate(prompts, params)]
    llm = LLM(str(folder), enforce_eager=True, max_model_len=200, block_size=8, num_kv_blocks=30,
              enable_prefix_caching=False)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert out == ref
