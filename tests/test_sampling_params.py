import pytest

from compiled_llm.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.ignore_eos is False
    assert p.logprobs is None
    assert p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True
    assert p.spaces_between_special_tokens is True
    assert p.greedy is False


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=None, top_k=-1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == []
    assert p.top_k == 0
    q = SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4))
    assert q.stop == ["a", "b"]
    assert q.stop_token_ids == [3, 4]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=3)
    c = p.clone()
    assert c == p
    c.stop.append("y")
    c.stop_token_ids.append(2)
    assert p.stop == ["x"]
    assert p.stop_token_ids == [1]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.01), "min_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-5), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(presence_penalty=2.01), "presence_penalty"),
        (dict(presence_penalty=-2.01), "presence_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(seed="abc"), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_validation_errors(kwargs, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert field in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(top_p=1.0),
        dict(top_p=1e-3),
        dict(top_k=-1),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(repetition_penalty=0.01),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(min_tokens=16, max_tokens=16),
        dict(min_tokens=100, max_tokens=None),
        dict(seed=0),
    ],
)
def test_boundary_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        if k == "top_k" and v == -1:
            assert p.top_k == 0
        else:
            assert getattr(p, k) == v
