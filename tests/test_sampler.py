import math
from collections import Counter

import pytest
import torch

from compiled_llm.runtime.sampler import (
    SampleResult,
    Sampler,
    SamplingRow,
    apply_penalties,
)
from compiled_llm.sampling_params import SamplingParams


def row(prompt=(), output=(), generator=None, stop_ids=(), **kw):
    return SamplingRow(
        params=SamplingParams(**kw),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generator=generator,
        stop_token_ids=set(stop_ids),
    )


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# Probabilities 0.5, 0.3, 0.1, 0.05, 0.05 (token order deliberately shuffled).
PROBS = torch.tensor([0.05, 0.3, 0.5, 0.05, 0.1])
LOGITS = PROBS.log()


def draw_many(n, **kw):
    torch.manual_seed(0)
    logits = LOGITS.repeat(n, 1)
    res = Sampler()(logits, [row(**kw) for _ in range(n)])
    return Counter(r.token_id for r in res)


def test_greedy_is_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    res = Sampler()(logits, [row(temperature=0.0) for _ in range(6)])
    assert [r.token_id for r in res] == logits.argmax(-1).tolist()
    assert all(isinstance(r, SampleResult) and r.logprob is None and r.rank is None for r in res)
    # Independent of the global RNG.
    torch.manual_seed(999)
    res2 = Sampler()(logits, [row(temperature=0.0) for _ in range(6)])
    assert [r.token_id for r in res2] == [r.token_id for r in res]


@pytest.mark.parametrize("rows", [
    [row(output=[1, 1], repetition_penalty=1.5, frequency_penalty=1.0), row(temperature=0.5)],
    [row(stop_ids=[3], min_tokens=2), row(temperature=0.0)],
    # no penalty, min_tokens or grammar: the sampler makes no copy, and nothing after writes to the logits
    [row(temperature=0.0), row(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05, logprobs=2)],
])
def test_caller_logits_not_modified(rows):
    logits = torch.randn(2, 10)
    before = logits.clone()
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(8, 100)
    res = Sampler()(logits, [row(temperature=1.3, top_k=1) for _ in range(8)])
    assert [r.token_id for r in res] == logits.argmax(-1).tolist()


def test_unrestricted_sampling_covers_vocab():
    c = draw_many(4000)
    assert set(c) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize(
    "kw, allowed",
    [
        (dict(top_k=2), {2, 1}),
        (dict(top_k=3), {2, 1, 4}),
        (dict(top_p=0.75), {2, 1}),  # 0.5 < 0.75 <= 0.8
        (dict(top_p=0.45), {2}),
        (dict(top_p=0.85), {2, 1, 4}),  # 0.8 < 0.85 <= 0.9
        (dict(min_p=0.25), {2, 1}),  # threshold 0.125
        (dict(min_p=0.15), {2, 1, 4}),  # threshold 0.075
        # top-p applies to the top-k renormalised distribution: 0.5/0.9 < 0.85 <= 0.8/0.9
        (dict(top_k=3, top_p=0.85), {2, 1}),
        (dict(top_k=4, min_p=0.25), {2, 1}),
    ],
)
def test_filters_restrict_to_allowed_set(kw, allowed):
    c = draw_many(3000, **kw)
    assert set(c) == allowed  # never outside, and every allowed token shows up


def test_filters_with_mixed_rows_in_one_batch():
    torch.manual_seed(3)
    n = 600
    logits = LOGITS.repeat(4 * n, 1)
    rows = []
    for _ in range(n):
        rows += [row(top_k=2), row(top_p=0.45), row(min_p=0.15), row()]
    res = Sampler()(logits, rows)
    toks = [r.token_id for r in res]
    assert set(toks[0::4]) == {2, 1}
    assert set(toks[1::4]) == {2}
    assert set(toks[2::4]) == {2, 1, 4}
    assert set(toks[3::4]) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_temperature_matches_softmax_distribution(temperature):
    n = 20000
    c = draw_many(n, temperature=temperature)
    expected = torch.softmax(LOGITS / temperature, -1)
    for t in range(5):
        assert abs(c[t] / n - expected[t].item()) < 0.015


def test_temperature_sharpens_and_flattens():
    n = 5000
    cold = draw_many(n, temperature=0.2)[2] / n
    base = draw_many(n, temperature=1.0)[2] / n
    hot = draw_many(n, temperature=5.0)[2] / n
    assert cold > 0.9 > base > 0.4 > hot


def _sample_steps(batch_builder, steps=8):
    """Run several steps; batch_builder(step) -> (logits, rows, index of the row under test)."""
    out = []
    for s in range(steps):
        logits, rows, i = batch_builder(s)
        out.append(Sampler()(logits, rows)[i].token_id)
    return out


def test_seeded_rows_reproducible_and_batch_independent():
    V = 64
    torch.manual_seed(5)
    step_logits = [torch.randn(V) for _ in range(8)]

    g_alone = gen(1234)

    def alone(s):
        return step_logits[s].unsqueeze(0), [row(generator=g_alone, seed=1234)], 0

    tokens_alone = _sample_steps(alone)

    g_batch = gen(1234)
    g_other = gen(77)

    def batched(s):
        torch.manual_seed(100 + s)  # different global RNG state must not matter
        logits = torch.randn(5, V) * 3
        logits[2] = step_logits[s]
        rows = [
            row(),
            row(temperature=0.0),
            row(generator=g_batch, seed=1234),
            row(generator=g_other, seed=77, top_k=5),
            row(temperature=0.7, top_p=0.9),
        ]
        return logits, rows, 2

    tokens_batch = _sample_steps(batched)
    assert tokens_alone == tokens_batch

    g_diff = gen(4321)

    def other_seed(s):
        return step_logits[s].unsqueeze(0), [row(generator=g_diff, seed=4321)], 0

    assert _sample_steps(other_seed) != tokens_alone


def test_seeded_rows_respect_filters():
    g = gen(9)
    logits = LOGITS.repeat(500, 1)
    # all rows share one generator: the draws differ from row to row
    res = Sampler()(logits, [row(generator=g, seed=9, top_k=2) for _ in range(500)])
    assert {r.token_id for r in res} == {2, 1}


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    rows = [
        row(prompt=[0, 1], output=[3, 3, 4], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        row(prompt=[0, 1], output=[3, 3, 4]),  # no penalties: unchanged
    ]
    out = apply_penalties(logits.clone(), rows)
    # repetition over prompt+output {0,1,3,4}: 2/2, -1*2, 0.5, 3/2, -2*2
    # frequency/presence over output only: token 3 count 2, token 4 count 1
    expected0 = torch.tensor([1.0, -2.0, 0.5, 1.5 - 2 * 0.5 - 0.25, -4.0 - 1 * 0.5 - 0.25])
    torch.testing.assert_close(out[0], expected0)
    torch.testing.assert_close(out[1], logits[1])


def test_frequency_and_presence_only_count_output_tokens():
    logits = torch.zeros(1, 4)
    out = apply_penalties(logits.clone(), [row(prompt=[0, 0, 0], output=[1, 2, 2], frequency_penalty=1.0, presence_penalty=0.5)])
    torch.testing.assert_close(out[0], torch.tensor([0.0, -1.5, -2.5, 0.0]))


def test_negative_penalties_encourage():
    logits = torch.tensor([[1.0, 1.0, -1.0]])
    out = apply_penalties(logits.clone(), [row(output=[2], frequency_penalty=-1.0, presence_penalty=-0.5, repetition_penalty=0.5)])
    # repetition 0.5 on token 2: -1 * 0.5 = -0.5; then +1 +0.5
    torch.testing.assert_close(out[0], torch.tensor([1.0, 1.0, 1.0]))


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 3)
    rows = [
        row(temperature=0.0, output=[3]),
        row(temperature=0.0, output=[3], presence_penalty=1.5),  # 3 -> 1.5 < 2
        row(temperature=0.0, prompt=[3], repetition_penalty=2.0),  # 3 -> 1.5 < 2
    ]
    assert [r.token_id for r in Sampler()(logits, rows)] == [3, 0, 0]


def test_min_tokens_masks_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.0]] * 4)
    rows = [
        row(temperature=0.0, output=[1], min_tokens=3, stop_ids={0}),  # masked -> 3
        row(temperature=0.0, output=[1, 1, 1], min_tokens=3, stop_ids={0}),  # reached -> 0
        row(temperature=0.0, output=[], min_tokens=2, stop_ids={0, 3}),  # both masked -> 1
        row(temperature=0.0, output=[], min_tokens=0, stop_ids={0}),  # no min_tokens -> 0
    ]
    assert [r.token_id for r in Sampler()(logits, rows)] == [3, 0, 1, 0]


def test_min_tokens_masks_stop_ids_when_sampling():
    torch.manual_seed(0)
    n = 2000
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0]]).repeat(n, 1)
    rows = [row(output=[], min_tokens=1, stop_ids={0}, stop_token_ids=[3]) for _ in range(n)]
    toks = {r.token_id for r in Sampler()(logits, rows)}
    assert toks == {1, 2}


def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(4)
    logits = torch.randn(3, 30) * 2
    raw_lp = torch.log_softmax(logits, -1)
    order = raw_lp.argsort(-1, descending=True)
    second = order[0, 1].item()
    # Row 0: greedy, but a presence penalty on the best token pushes the choice to the 2nd best.
    best0 = order[0, 0].item()
    rows = [
        row(temperature=0.0, output=[best0], presence_penalty=2.0, repetition_penalty=1.0, logprobs=3),
        row(temperature=0.8, logprobs=5, seed=1, generator=gen(1)),
        row(temperature=0.0, logprobs=0),
    ]
    # Make sure the penalty really flips the choice for row 0.
    logits[0, best0] = logits[0, second] + 1.0
    raw_lp = torch.log_softmax(logits, -1)
    order = raw_lp.argsort(-1, descending=True)
    res = Sampler()(logits, rows)

    assert res[0].token_id == second
    assert res[0].rank == 2
    for i, r in enumerate(res):
        assert r.logprob == pytest.approx(raw_lp[i, r.token_id].item(), abs=1e-6)
        expected_rank = int((raw_lp[i] > raw_lp[i, r.token_id]).sum()) + 1
        assert r.rank == expected_rank
        n = rows[i].params.logprobs
        assert [t for t, _ in r.top_logprobs] == order[i, :n].tolist()
        for t, lp in r.top_logprobs:
            assert lp == pytest.approx(raw_lp[i, t].item(), abs=1e-6)
        vals = [lp for _, lp in r.top_logprobs]
        assert vals == sorted(vals, reverse=True)
    assert res[2].top_logprobs == []
    assert res[2].rank == 1
    assert math.isfinite(res[2].logprob)


def test_logprobs_only_for_rows_that_ask():
    logits = torch.randn(3, 10)
    rows = [row(temperature=0.0), row(temperature=0.0, logprobs=2), row(temperature=0.0)]
    res = Sampler()(logits, rows)
    assert res[0].logprob is None and res[0].top_logprobs == []
    assert res[2].logprob is None
    lp = torch.log_softmax(logits[1], -1)
    assert res[1].logprob == pytest.approx(lp.max().item(), abs=1e-6)
    assert res[1].rank == 1
    assert len(res[1].top_logprobs) == 2
    assert res[1].top_logprobs[0][0] == res[1].token_id


def test_logprobs_ignore_temperature_and_filters():
    torch.manual_seed(6)
    logits = torch.randn(200, 20)
    rows = [row(temperature=0.3, top_k=3, logprobs=1) for _ in range(200)]
    res = Sampler()(logits, rows)
    raw_lp = torch.log_softmax(logits, -1)
    for i, r in enumerate(res):
        assert r.rank <= 3  # top-k=3 keeps ranks 1..3
        assert r.logprob == pytest.approx(raw_lp[i, r.token_id].item(), abs=1e-6)


def test_empty_batch_and_row_mismatch():
    assert Sampler()(torch.zeros(0, 5), []) == []
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [row()])



def test_logit_bias_and_allowed_token_ids():
    torch.manual_seed(4)
    logits = torch.randn(5, 50)
    best, second = logits[1].topk(2).indices.tolist()
    allowed = [3, 9]
    rows = [row(temperature=0.0, logit_bias={7: 100.0}), row(temperature=0.0, logit_bias={best: -100.0}),
            row(temperature=0.0, allowed_token_ids=allowed), row(temperature=0.0),
            row(temperature=1.0, allowed_token_ids=allowed, generator=gen(0))]
    res = [r.token_id for r in Sampler()(logits, rows)]
    assert res[:4] == [7, second, max(allowed, key=lambda t: logits[2, t]), logits[3].argmax().item()]
    draws = {Sampler()(logits[4:], [row(temperature=1.0, allowed_token_ids=allowed, generator=gen(s))])[0].token_id
             for s in range(40)}
    assert draws == set(allowed) and res[4] in allowed


def test_bad_words_ban_a_word_s_last_token_after_the_rest():
    """bad_words as token sequences: a one-token word is never sampled; a longer word's last token is banned only
    where the output ends with the word's other tokens."""
    torch.manual_seed(5)
    logits = torch.randn(4, 30)
    best, second = logits[0].topk(2).indices.tolist()
    one = row(temperature=0.0, output=[1, 2])
    one.bad_words = [[best]]
    b1 = logits[1].argmax().item()
    after = row(temperature=0.0, output=[4, 7])
    after.bad_words = [[7, b1]]  # the output ends with 7: b1 would complete the word
    b2 = logits[2].argmax().item()
    not_after = row(temperature=0.0, output=[7, 4])
    not_after.bad_words = [[7, b2]]  # it does not: b2 stays allowed
    b3 = logits[3].topk(2).indices.tolist()
    longer = row(temperature=0.0, output=[9, 5, 6])
    longer.bad_words = [[5, 6, b3[0]], [6, 5, b3[1]]]  # only the first one's head matches
    res = [r.token_id for r in Sampler()(logits, [one, after, not_after, longer])]
    assert res[0] == second and res[1] != b1 and res[2] == b2 and res[3] == b3[1]
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", "  "])
