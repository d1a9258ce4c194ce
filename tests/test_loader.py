"""Checkpoint loading: layouts, strictness, dtypes, dummy weights, the registry."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_llm import LLM, SamplingParams
from compiled_llm.models.registry import resolve_model_class
from tiny_models import hf_greedy, make_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def ids_of(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_sharded_checkpoint_with_index(tmp_path, tiny_ckpt):
    folder, hf = tiny_ckpt("ple")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    make_tokenizer(sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    a = LLM(str(folder), enforce_eager=True, max_model_len=64).generate(prompt, GREEDY)
    b = LLM(str(sharded), enforce_eager=True, max_model_len=64).generate(prompt, GREEDY)
    assert ids_of(a) == ids_of(b) == [hf_greedy(hf, prompt["prompt_token_ids"], 16)]


def _copy(folder, dst):
    shutil.copytree(folder, dst)
    return dst, load_file(str(dst / "model.safetensors"))


def test_strict_loading_names_the_tensor(tmp_path, tiny_ckpt):
    folder, _ = tiny_ckpt("dense")
    d, w = _copy(folder, tmp_path / "misshapen")
    w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"][:-1]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight has shape"):
        LLM(str(d))
    d, w = _copy(folder, tmp_path / "missing")
    del w["model.layers.1.self_attn.o_proj.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*model.layers.1.self_attn.o_proj.weight"):
        LLM(str(d))
    d, w = _copy(folder, tmp_path / "unexpected")
    w["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected.*model.layers.0.extra.weight"):
        LLM(str(d))
    d, _ = _copy(folder, tmp_path / "badindex")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(ValueError, match="model-00002.safetensors"):
        LLM(str(d))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_cast(tiny_ckpt, dtype):
    folder, hf = tiny_ckpt("dense")
    llm = LLM(str(folder), enforce_eager=True, dtype=dtype, max_model_len=64)
    model = llm.engine.executor.runner.model
    assert all(p.dtype == getattr(torch, dtype) for p in model.parameters())
    assert all(c.dtype == getattr(torch, dtype) for c in llm.engine.executor.runner.kv_caches.values())
    prompt = [5, 6, 7, 8, 9, 10]
    ours = ids_of(llm.generate({"prompt_token_ids": prompt}, GREEDY))[0]
    ref = hf_greedy(hf, prompt, 16)
    assert sum(a == b for a, b in zip(ours, ref)) >= 4  # low precision drifts, but starts on the same path
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(folder), dtype="int3")


def test_dummy_weights(tiny_ckpt):
    folder, _ = tiny_ckpt("moe")
    a = LLM(str(folder), enforce_eager=True, load_format="dummy", seed=3, max_model_len=64)
    b = LLM(str(folder), enforce_eager=True, load_format="dummy", seed=3, max_model_len=64)
    c = LLM(str(folder), enforce_eager=True, load_format="auto", max_model_len=64)
    wa = a.engine.executor.runner.model.model.layers[0].experts.gate_up_proj
    assert torch.equal(wa, b.engine.executor.runner.model.model.layers[0].experts.gate_up_proj)
    assert not torch.equal(wa, c.engine.executor.runner.model.model.layers[0].experts.gate_up_proj)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    assert ids_of(a.generate(prompt, GREEDY)) == ids_of(b.generate(prompt, GREEDY))


def test_conditional_generation_checkpoint_served_text_only(tmp_path):
    from transformers import (Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig,
                              Gemma4VisionConfig)

    tok = make_tokenizer(tmp_path)
    text = Gemma4TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                            vocab_size_per_layer_input=len(tok), sliding_window=8, eos_token_id=1)
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    audio = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32,
                              subsampling_conv_channels=[8, 4])
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision,
                                                     audio_config=audio)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.normal_(1.0, 0.3)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), enforce_eager=True, max_model_len=64)
    ids = [5, 9, 14, 20, 33, 41, 50]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, -1]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=1))[0]
    lp = out.outputs[0].logprobs[0]
    best = int(ref.argmax())
    assert out.outputs[0].token_ids == [best]
    assert abs(lp[best].logprob - torch.log_softmax(ref.float(), -1)[best].item()) < 1e-4


def test_registry_declares_capabilities():
    from compiled_llm.models.interfaces import supports_multimodal, supports_pp, supports_tp, uses_mrope

    cls = resolve_model_class({"architectures": ["Gemma4ForCausalLM"]})
    assert supports_multimodal(cls) is False and uses_mrope(cls) is False
    assert supports_pp(cls) and supports_tp(cls)
    with pytest.raises(ValueError, match="supported:"):
        resolve_model_class({"architectures": ["LlamaForCausalLM"]})
