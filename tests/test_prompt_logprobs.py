"""Prompt logprobs (SamplingParams.prompt_logprobs, runtime/prompt_logprobs.py) against transformers' own model,
over chunked prefill and with the prefix cache on; and /v1/completions' echo with logprobs (a text scored, as
evaluation harnesses ask) and vLLM's prompt_logprobs field, through the official client."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from server_utils import FakeServers

from compiled_llm import LLM, SamplingParams
from compiled_llm.runtime import prompt_logprobs
from compiled_llm.server.app import create_app

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    folder, hf = tiny_ckpt("dense")
    # 8-token chunks: a prompt's entries come from several steps
    llm = LLM(str(folder), enforce_eager=True, dtype="float32", block_size=4, max_model_len=128,
              max_num_batched_tokens=8, enable_prefix_caching=True)
    return llm, hf


def values(out, approx=False):
    """Each prompt entry's token -> logprob (approx: to 1e-4; other batches or chunks sum in another order)."""
    return [e and {t: pytest.approx(lp.logprob, abs=1e-4) if approx else lp.logprob for t, lp in e.items()}
            for e in out.prompt_logprobs]


def test_prompt_logprobs_match_transformers(model, monkeypatch):
    llm, hf = model
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    assert len(ids) > 16 and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        own = entry[ids[p]]
        assert math.isclose(own.logprob, ref[p - 1, ids[p]].item(), abs_tol=1e-4), p
        assert own.rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        top = ref[p - 1].topk(3)
        assert {t: entry[t].rank for t in top.indices.tolist()} == {t: r for r, t in
                                                                      enumerate(top.indices.tolist(), start=1)}
        assert len(entry) in (3, 4)  # the prompt token, and the top 3 (it may be one of them)

    # again: the prefix cache holds the prompt, but every token is computed, so the entries are all there;
    # a request beside it without prompt logprobs samples as it does alone
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate("Once upon a time", plain)[0].outputs[0].token_ids
    both = llm.generate([PROMPT, "Once upon a time"],
                        [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2), plain])
    assert both[0].num_cached_tokens == 0 and values(both[0]) == values(out, approx=True)
    assert both[1].outputs[0].token_ids == alone and both[1].prompt_logprobs is None
    assert llm.generate(PROMPT, plain)[0].num_cached_tokens > 0  # others still hit the cache

    # the LM head makes PIECE_ROWS rows of prompt logits at a time, and the prompt still goes in chunks of the
    # whole token budget (8 here): one step a chunk, then one for the second token
    monkeypatch.setattr(prompt_logprobs, "PIECE_ROWS", 3)
    steps = llm.engine.sync_steps
    again = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert values(again) == values(out, approx=True)
    assert llm.engine.sync_steps - steps == math.ceil(len(ids) / 8) + 1


def test_async_scheduling_engine_gives_the_same_entries(model, tiny_ckpt):
    llm, _ = model
    fast = LLM(str(tiny_ckpt("dense")[0]), enforce_eager=True, dtype="float32", block_size=4, max_model_len=128,
               async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)
    got = fast.generate(PROMPT, params)[0]
    want = llm.generate(PROMPT, params)[0]
    assert values(got) == values(want, approx=True)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_completions_echo_with_logprobs(model):
    llm, _ = model
    # the offline answer before the server starts: the server's engine thread steps this engine too, and two
    # threads stepping one engine race on the forward context (a CI run's engine thread died of it)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    ids = want.prompt_token_ids
    msgs = [{"role": "user", "content": PROMPT}]  # (the chat case's offline answer too)
    chat_ids = llm.get_tokenizer().encode(llm.engine.apply_chat_template(msgs), add_special_tokens=False)
    chat_want = llm.generate({"prompt_token_ids": chat_ids}, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    with TestClient(create_app(llm.engine, tokenizer_info_endpoint=True)) as client:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        name = llm.engine.model_name
        out = oai.completions.create(model=name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0)
        lp = out.choices[0].logprobs
        assert out.choices[0].text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(
            [want.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))], abs=1e-5)
        assert lp.text_offset == sorted(lp.text_offset)
        assert out.choices[0].model_extra["prompt_logprobs"] is None  # only when asked for

        streamed = {"tokens": [], "token_logprobs": [], "text": ""}
        for chunk in oai.completions.create(model=name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1,
                                            temperature=0, stream=True):
            c = chunk.choices[0]
            streamed["text"] += c.text
            if c.logprobs is not None:
                streamed["tokens"] += c.logprobs.tokens
                streamed["token_logprobs"] += c.logprobs.token_logprobs
        assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text": out.choices[0].text}

        # lm-evaluation-harness's remote-tokenizer probe, then its log-likelihood request, parsed as it parses it
        info = client.get("/tokenizer_info").json()
        assert info["eos_token"] == llm.engine.tokenizer.eos_token and info["chat_template"]
        assert client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]
        ctx, cont = ids[:10], ids[10:14]
        body = client.post("/v1/completions", json={"model": name, "prompt": [ctx + cont, ids[:6]], "temperature": 0,
                                                     "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
        choice = sorted(body.json()["choices"], key=lambda c: c["index"])[0]["logprobs"]
        assert sum(choice["token_logprobs"][len(ctx):-1]) == pytest.approx(
            sum(want.prompt_logprobs[p][ids[p]].logprob for p in range(10, 14)), abs=1e-4)
        greedy = all(t == max(top.values()) for t, top in zip(choice["token_logprobs"][len(ctx):-1],
                                                              choice["top_logprobs"][len(ctx):-1]))
        assert greedy == all(want.prompt_logprobs[p][ids[p]].rank == 1 for p in range(10, 14))

        ext = oai.completions.create(model=name, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0})
        entries = ext.choices[0].model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(ids)
        assert entries[1] == {str(ids[1]): pytest.approx({"logprob": want.prompt_logprobs[1][ids[1]].logprob,
                                                          "rank": want.prompt_logprobs[1][ids[1]].rank,
                                                          "decoded_token": want.prompt_logprobs[1][ids[1]].decoded_token})}
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(model=name, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1})
        assert err.value.body["param"] == "prompt_logprobs"

        # chat (vLLM's): the rendered conversation's entries at the response's top level
        chat = oai.chat.completions.create(model=name, messages=msgs, max_tokens=1, extra_body={"prompt_logprobs": 2})
        ids, want = chat_ids, chat_want
        entries = chat.model_extra["prompt_logprobs"]
        assert chat.usage.prompt_tokens == len(ids) == len(entries) and entries[0] is None
        for p in range(1, len(ids)):
            assert {int(t): (e["logprob"], e["rank"]) for t, e in entries[p].items()} == \
                {t: (pytest.approx(lp.logprob, abs=1e-4), lp.rank) for t, lp in want.prompt_logprobs[p].items()}
        assert oai.chat.completions.create(model=name, messages=msgs, max_tokens=1).model_extra.get(
            "prompt_logprobs") is None
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=name, messages=msgs, stream=True, extra_body={"prompt_logprobs": 1})
        assert err.value.body["param"] == "prompt_logprobs"


def test_tokenizer_info_is_opt_in():
    servers = FakeServers()
    try:
        _, oai = servers.make()
        assert oai._client.get("http://testserver/tokenizer_info").status_code == 404
    finally:
        servers.close()
