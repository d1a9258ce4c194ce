import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from compiled_llm.runtime.detokenizer import IncrementalDetokenizer, find_stop_string

FFFD = "\ufffd"

TRAIN = [
    "The café is naïve about crème brûlée.",
    "日本語のテキストを書きます。日本は美しい国です。",
    "Emoji time 😀🎉👍 and more 🚀 rockets!",
    "Hello world, hello there. The quick brown fox jumps over the lazy dog.",
    "Ünïcödé straße, Ελληνικά, русский текст.",
]

TEXTS = TRAIN + [
    "naïve café 日本語 😀!",
    "Mixed: ü😀é日本🎉 end",
    "  leading spaces and trailing   ",
    "👍👍👍 three thumbs",
]


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,  # small: many multi-byte characters stay split over several tokens
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator(TRAIN * 3, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=t, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def enc(tok, s):
    return tok.encode(s, add_special_tokens=False)


def test_tokenizer_splits_characters_across_tokens(tok):
    # Guard that the fixture really exercises the hard case.
    ids = enc(tok, "😀")
    assert len(ids) > 1
    assert FFFD in tok.decode(ids[:1])


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode_token_by_token(tok, text):
    ids = enc(tok, text)
    det = IncrementalDetokenizer(tok, prompt_token_ids=[])
    pieces = []
    complete = ""  # decode of the longest token prefix that ends on a whole character
    for k, t in enumerate(ids, 1):
        delta = det.append(t)
        assert FFFD not in delta
        pieces.append(delta)
        full = tok.decode(ids[:k], skip_special_tokens=True)
        if not full.endswith(FFFD):
            complete = full
        else:
            assert delta == ""
        assert det.text == "".join(pieces) == complete
    assert det.text == tok.decode(ids) == text
    assert det.output_token_ids == ids


@pytest.mark.parametrize("split", [0.3, 0.5, 0.8])
@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_context(tok, text, split):
    ids = enc(tok, text)
    cut = int(len(ids) * split)
    while tok.decode(ids[:cut]).endswith(FFFD):  # prompt ending mid-character: tested separately
        cut -= 1
    prompt, output = ids[:cut], ids[cut:]
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    out = "".join(det.append(t) for t in output)
    assert out == det.text == tok.decode(output, skip_special_tokens=True)
    assert tok.decode(prompt) + out == text


def test_multibyte_character_emitted_whole_once_complete(tok):
    ids = enc(tok, "a🚀")
    det = IncrementalDetokenizer(tok, prompt_token_ids=enc(tok, "x"))
    deltas = [det.append(t) for t in ids]
    assert "".join(deltas) == "a🚀"
    # the rocket arrives in exactly one delta, the steps before it add no replacement chars
    assert sum("🚀" in d for d in deltas) == 1
    rocket_step = next(i for i, d in enumerate(deltas) if "🚀" in d)
    assert rocket_step == len(ids) - 1
    assert all(FFFD not in d for d in deltas)
    assert len(ids) >= 3 and deltas[-2] == ""


def test_incomplete_tail_is_held_back_and_flush_emits_it(tok):
    ids = enc(tok, "ok 😀")
    partial = ids[:-1]
    assert tok.decode(partial).endswith(FFFD)
    det = IncrementalDetokenizer(tok, prompt_token_ids=[])
    text = "".join(det.append(t) for t in partial)
    assert FFFD not in text
    last_complete = max(j for j in range(len(partial) + 1) if not tok.decode(partial[:j]).endswith(FFFD))
    assert text == tok.decode(partial[:last_complete])
    assert text.startswith("ok")
    tail = det.flush()
    assert tail == tok.decode(partial)[len(text):]
    assert FFFD in tail
    assert det.text == tok.decode(partial)
    assert det.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    eos = tok.eos_token_id
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = enc(tok, "Hello café") + [eos] + enc(tok, " naïve") + [im_start] + enc(tok, "😀")
    det = IncrementalDetokenizer(tok, prompt_token_ids=enc(tok, "The"), skip_special_tokens=skip)
    text = "".join(det.append(t) for t in ids)
    assert text == tok.decode(ids, skip_special_tokens=skip)
    if skip:
        assert text == "Hello café naïve😀"
    else:
        assert text == "Hello café<|endoftext|> naïve<|im_start|>😀"


def test_special_tokens_in_prompt_tail_are_skipped(tok):
    prompt = enc(tok, "Hi") + [tok.eos_token_id]
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    out = enc(tok, " there")
    assert "".join(det.append(t) for t in out) == " there"


def test_prompt_ending_mid_character(tok):
    ids = enc(tok, "go 🚀 now")
    # find a cut where the prompt ends in the middle of the rocket
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    det = IncrementalDetokenizer(tok, ids[:cut])
    out = "".join(det.append(t) for t in ids[cut:])
    assert out == tok.decode(ids[cut:])
    assert out.endswith(" now")


# ---------------------------------------------------------------- find_stop_string


def test_find_stop_exclude_and_include():
    assert find_stop_string("Hello world!", 12, ["world"], include=False) == ("world", 6)
    assert find_stop_string("Hello world!", 12, ["world"], include=True) == ("world", 11)


def test_find_stop_none_when_absent_or_no_new_chars():
    assert find_stop_string("Hello world", 5, ["xyz"], include=False) is None
    assert find_stop_string("Hello world", 0, ["world"], include=False) is None
    assert find_stop_string("Hello world", 3, [], include=False) is None


def test_find_stop_only_where_new_chars_could_complete_it():
    # "STOP" lies entirely in the old text -> already checked, not reported again
    assert find_stop_string("abc STOP def", 3, ["STOP"], include=False) is None
    # one new char completes it
    assert find_stop_string("abc STOP", 1, ["STOP"], include=False) == ("STOP", 4)
    assert find_stop_string("abc STOP", 1, ["STOP"], include=True) == ("STOP", 8)


def test_find_stop_earliest_wins():
    assert find_stop_string("abcdef", 6, ["def", "cd"], include=False) == ("cd", 2)
    assert find_stop_string("abcdef", 6, ["def", "cd"], include=True) == ("cd", 4)
    # same start: first listed
    assert find_stop_string("abcdef", 6, ["cde", "cd"], include=True) == ("cde", 5)


def test_find_stop_spanning_two_appends():
    text = "Hello wo"
    assert find_stop_string(text, len(text), ["world"], include=False) is None
    text += "rld and more"
    assert find_stop_string(text, 12, ["world"], include=False) == ("world", 6)
    assert find_stop_string(text, 12, ["world"], include=True) == ("world", 11)


@pytest.mark.parametrize("include, expected", [(False, "Le café est naïve. "), (True, "Le café est naïve. 日本語")])
def test_stop_with_detokenizer(tok, include, expected):
    ids = enc(tok, "Le café est naïve. 日本語 and then more text")
    det = IncrementalDetokenizer(tok, [])
    hit = None
    for t in ids:
        delta = det.append(t)
        hit = find_stop_string(det.text, len(delta), ["日本語", "never"], include)
        if hit:
            break
    assert hit is not None and hit[0] == "日本語"
    assert "日本語" not in delta  # the stop string was completed across appends
    assert det.text[: hit[1]] == expected
