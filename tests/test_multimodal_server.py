"""Media content parts through the OpenAI-compatible server (in process, the official openai client on top
of FastAPI's TestClient), the media checks (400s) and the serve flags."""

import base64
import io
import wave

import numpy as np
import openai
import pytest

from compiled_llm import LLM, SamplingParams
from multimodal_tiny import audio_clip, image, make_mm_checkpoint, video_clip

MAX_BYTES = 200_000


def png_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def wav_b64(a: np.ndarray, rate: int = 16_000) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(a, -1, 1) * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def gif_url(frames: np.ndarray) -> str:
    from PIL import Image

    imgs = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    imgs[0].save(buf, format="GIF", save_all=True, append_images=imgs[1:], duration=100, loop=0)
    return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def mm_server(tmp_path_factory):
    from fastapi.testclient import TestClient

    from compiled_llm.multimodal.media import MediaPolicy
    from compiled_llm.server.app import create_app

    folder = tmp_path_factory.mktemp("gemma4_mm_server")
    make_mm_checkpoint(folder)
    media_dir = tmp_path_factory.mktemp("media")
    image(5).save(media_dir / "ok.png")
    image(5).save(media_dir.parent / "outside.png")
    (media_dir / "big.bin").write_bytes(b"\0" * (MAX_BYTES + 1))
    llm = LLM(str(folder), enforce_eager=True, max_model_len=400, block_size=8)
    policy = MediaPolicy(allowed_domains=["example.com"], allowed_local_path=str(media_dir),
                         limits={"image": 2, "audio": 1, "video": 1}, max_bytes=MAX_BYTES)
    app = create_app(llm.engine, served_model_names=["mm"], media_policy=policy)
    with TestClient(app) as http:
        yield http, folder, media_dir


@pytest.fixture(scope="module")
def client(mm_server):
    http, _, _ = mm_server
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


TEXT = {"type": "text", "text": "Describe"}


def test_openai_client_sends_image_audio_and_video(mm_server, client):
    _, folder, _ = mm_server
    from compiled_llm.multimodal.media import decode_video

    frames = video_clip(4)
    msgs = user(TEXT, {"type": "image_url", "image_url": {"url": png_url(image(1))}},
                {"type": "input_audio", "input_audio": {"data": wav_b64(audio_clip(2)), "format": "wav"}},
                {"type": "video_url", "video_url": {"url": gif_url(frames)}})
    out = client.chat.completions.create(model="mm", messages=msgs, max_tokens=6, temperature=0)
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens > 150
    # the same prompt offline gives the same tokens
    llm = LLM(str(folder), enforce_eager=True, max_model_len=400, block_size=8)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Describe\n<|image|>\n<|audio|>\n<|video|>"}],
                                   tokenize=False, add_generation_prompt=True)
    pcm = np.frombuffer(base64.b64decode(wav_b64(audio_clip(2)))[44:], "<i2").astype(np.float32) / 32768
    video = decode_video(base64.b64decode(gif_url(frames).split(",")[1]))  # the GIF's own (quantised) frames
    ref = llm.generate({"prompt": text, "add_special_tokens": False, "multi_modal_data": {
        "image": image(1), "audio": [(pcm, 16_000)], "video": [video]}}, SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.choices[0].message.content == ref.outputs[0].text


def test_responses_api_takes_an_image_and_a_local_file(mm_server, client):
    _, _, media_dir = mm_server
    r = client.responses.create(model="mm", max_output_tokens=4, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_text", "text": "What"},
                                    {"type": "input_image", "image_url": png_url(image(3))}]}])
    assert r.usage.output_tokens == 4
    ok = client.chat.completions.create(model="mm", max_tokens=2, messages=user(
        TEXT, {"type": "image_url", "image_url": {"url": "file://" + str(media_dir / "ok.png")}}))
    assert ok.usage.completion_tokens == 2


BAD = {
    "malformed base64": ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not base64@@"}},
                         "base64"),
    "undecodable image": ({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()}}, "cannot be decoded"),
    "undecodable audio": ({"type": "input_audio", "input_audio": {
        "data": base64.b64encode(b"RIFFnonsense").decode(), "format": "wav"}}, "WAV"),
    "undecodable video": ({"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(b"\0\0\0 ftypnope").decode()}}, "video"),
    "domain not allowed": ({"type": "image_url", "image_url": {"url": "https://evil.test/a.png"}}, "not allowed"),
    "local file outside": ({"type": "image_url", "image_url": {"url": "file://{dir}/../outside.png"}},
                           "allowed-local"),
    "file too large": ({"type": "image_url", "image_url": {"url": "file://{dir}/big.bin"}}, "limit"),
    "data URL too large": ({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + "A" * (MAX_BYTES * 2)}}, "limit"),
    "bad scheme": ({"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}, "scheme"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_media_is_400_and_server_keeps_serving(mm_server, case):
    http, _, media_dir = mm_server
    part, msg = BAD[case]
    if "{dir}" in str(part):
        part = {"type": "image_url", "image_url": {"url": part["image_url"]["url"].format(dir=media_dir)}}
    r = http.post("/v1/chat/completions", json={"messages": user(TEXT, part), "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert msg.lower() in r.json()["error"]["message"].lower()
    ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_too_many_items_and_placeholder_mismatch_are_400(mm_server):
    http, _, _ = mm_server
    img = {"type": "image_url", "image_url": {"url": png_url(image(1))}}
    r = http.post("/v1/chat/completions", json={"messages": user(TEXT, img, img, img), "max_tokens": 2})
    assert r.status_code == 400 and "too many image" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": user(
        {"type": "text", "text": "a literal <|image|> placeholder"}, img), "max_tokens": 2})
    assert r.status_code == 400 and "placeholder" in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200


def test_text_only_checkpoint_answers_400_for_media(tiny_ckpt):
    from fastapi.testclient import TestClient

    from compiled_llm.server.app import create_app

    folder, _ = tiny_ckpt("dense")
    llm = LLM(str(folder), enforce_eager=True, max_model_len=64)
    with TestClient(create_app(llm.engine)) as http:
        r = http.post("/v1/chat/completions", json={"messages": user(
            TEXT, {"type": "image_url", "image_url": {"url": png_url(image(1))}}), "max_tokens": 2})
        assert r.status_code == 400 and "does not take image" in r.json()["error"]["message"]
        ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2})
        assert ok.status_code == 200


def test_serve_flags_build_the_media_policy(tmp_path):
    import argparse

    from compiled_llm.server.cli import add_serve_args, media_policy_from_args

    args = add_serve_args(argparse.ArgumentParser()).parse_args([
        "--allowed-media-domains", "example.com", "cdn.example.org", "--allowed-local-media-path", str(tmp_path),
        "--limit-mm-per-prompt", "image=3,video=0", "--max-media-bytes", "1000"])
    p = media_policy_from_args(args)
    assert p.allowed_domains == ["example.com", "cdn.example.org"] and p.allowed_local_path == str(tmp_path)
    assert p.limits == {"image": 3, "audio": 4, "video": 0} and p.max_bytes == 1000


def test_openai_client_sends_an_image_to_qwen3_5(tmp_path):
    """A Qwen3.5 checkpoint: the image part becomes <|vision_start|><|image_pad|><|vision_end|> in the
    message; the answer equals the offline one for the same rendered prompt."""
    from fastapi.testclient import TestClient

    from compiled_llm.server.app import create_app
    from qwen3_5_tiny import make_qwen_vl_checkpoint

    make_qwen_vl_checkpoint(tmp_path)
    llm = LLM(str(tmp_path), enforce_eager=True, max_model_len=128, block_size=4)
    with TestClient(create_app(llm.engine, served_model_names=["qwen"])) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        out = client.chat.completions.create(model="qwen", max_tokens=5, temperature=0, messages=user(
            TEXT, {"type": "image_url", "image_url": {"url": png_url(image(1, 32, 32))}}))
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Describe\n<|vision_start|><|image_pad|><|vision_end|>"}], tokenize=False,
        add_generation_prompt=True)
    ref = llm.generate({"prompt": text, "add_special_tokens": False, "multi_modal_data": {"image": image(1, 32, 32)}},
                       SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.choices[0].message.content == ref.outputs[0].text


def test_tokenize_expands_media_placeholders(mm_server):
    """/tokenize of a chat with media gives the ids the model sees (the processor's expanded placeholders)."""
    from transformers import AutoProcessor

    from multimodal_tiny import IMAGE

    http, folder, _ = mm_server
    msgs = user(TEXT, {"type": "image_url", "image_url": {"url": png_url(image(1))}},
                {"type": "input_audio", "input_audio": {"data": wav_b64(audio_clip(2)), "format": "wav"}})
    r = http.post("/tokenize", json={"messages": msgs, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    proc = AutoProcessor.from_pretrained(folder)
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": "Describe\n<|image|>\n<|audio|>"}],
                                              tokenize=False, add_generation_prompt=True)
    pcm = np.frombuffer(base64.b64decode(wav_b64(audio_clip(2)))[44:], "<i2").astype(np.float32) / 32768
    want = proc(text=[text], images=[[image(1)]], audio=[pcm], add_special_tokens=False,
                return_tensors="pt")["input_ids"][0].tolist()
    assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] == 400
    assert want.count(IMAGE) > 1 and len(body["token_strs"]) == len(want)
    chat = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == body["count"]
    text_only = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert text_only.status_code == 200 and IMAGE not in text_only.json()["tokens"]


@pytest.mark.parametrize("case", ["malformed base64", "domain not allowed", "placeholder", "too many"])
def test_tokenize_bad_media_is_the_chat_400(mm_server, case):
    http, _, _ = mm_server
    img = {"type": "image_url", "image_url": {"url": png_url(image(1))}}
    parts = {"placeholder": [{"type": "text", "text": "a literal <|image|> placeholder"}, img],
             "too many": [TEXT, img, img, img]}.get(case) or [TEXT, BAD[case][0]]
    r = http.post("/tokenize", json={"messages": user(*parts)})
    chat = http.post("/v1/chat/completions", json={"messages": user(*parts), "max_tokens": 2})
    assert r.status_code == chat.status_code == 400, r.text
    assert r.json()["error"]["message"] == chat.json()["error"]["message"]
    assert r.json()["error"]["type"] == chat.json()["error"]["type"]


def test_the_media_processor_runs_off_the_engine_thread(mm_server, client, monkeypatch):
    """A media chat goes through the checkpoint's processor in a preprocessing thread (a ProcessedPrompt), so
    resizing and hashing the media never holds up the engine thread's steps; the prompt's expanded length is
    then known before admission, and a completion that would not fit is the context 400."""
    import threading

    from compiled_llm.runtime import input_processor

    names, real = [], input_processor.process_multimodal_prompt

    def recorded(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(input_processor, "process_multimodal_prompt", recorded)
    msgs = user(TEXT, {"type": "image_url", "image_url": {"url": png_url(image(2))}})
    out = client.chat.completions.create(model="mm", messages=msgs, max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    assert names and all(name.startswith("preprocess") for name in names)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="mm", messages=msgs, max_tokens=400 - out.usage.prompt_tokens + 1)
    assert "maximum context length is 400 tokens" in err.value.message and err.value.body["param"] == "max_tokens"
