"""Tiny random Gemma 4 checkpoints built with transformers itself: the oracle for our model."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks. "
    "Continuous batching schedules many sequences in one step. Once upon a time there was a tiny model. "
    "Sliding windows keep only recent tokens; global layers see everything. café naïve 日本語 🙂"
)

SLIDING, FULL = "sliding_attention", "full_attention"

# name -> Gemma4TextConfig overrides; each covers one feature of the model
CONFIGS: dict[str, dict] = {
    "dense": dict(layer_types=[SLIDING, FULL, SLIDING, FULL], hidden_size_per_layer_input=0),
    "moe": dict(layer_types=[SLIDING, SLIDING, FULL], enable_moe_block=True, num_experts=8, top_k_experts=2,
                moe_intermediate_size=24, hidden_size_per_layer_input=0),
    "moe16": dict(layer_types=[SLIDING, FULL], enable_moe_block=True, num_experts=16, top_k_experts=2,
                  moe_intermediate_size=24, hidden_size_per_layer_input=0),
    "ple": dict(layer_types=[SLIDING, FULL, SLIDING, FULL], hidden_size_per_layer_input=8),
    "shared_kv": dict(layer_types=[SLIDING, FULL, SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2,
                      hidden_size_per_layer_input=8),
    # global head_dim 64 with a quarter of it rotating: 8 rotated pairs a half, so the engine keeps their keys
    # beside each cached value (AttentionSpec.rot_keys 16)
    "k_eq_v": dict(layer_types=[SLIDING, FULL, SLIDING, FULL], attention_k_eq_v=True, num_global_key_value_heads=1,
                   global_head_dim=64, hidden_size_per_layer_input=0),
    "softcap": dict(layer_types=[SLIDING, FULL], final_logit_softcapping=5.0, hidden_size_per_layer_input=0),
    "mixed_heads": dict(layer_types=[SLIDING, FULL, FULL, SLIDING, FULL], global_head_dim=32,
                        num_global_key_value_heads=1, attention_k_eq_v=True, num_key_value_heads=4,
                        hidden_size_per_layer_input=0),
    "short_window": dict(layer_types=[SLIDING, SLIDING, FULL], sliding_window=6, hidden_size_per_layer_input=0),
    "all": dict(layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING, FULL], sliding_window=7,
                enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
                hidden_size_per_layer_input=8, num_kv_shared_layers=2, attention_k_eq_v=True,
                num_global_key_value_heads=1, global_head_dim=32, final_logit_softcapping=10.0),
}


def make_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<model>{% endif %}"
    )
    fast.save_pretrained(folder)
    return fast


def make_checkpoint(folder: Path, name: str, seed: int = 0, dtype=torch.float32):
    """Saves a random transformers Gemma4ForCausalLM (norms and layer scalars randomised too)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(folder)
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=12,
              max_position_embeddings=512, final_logit_softcapping=30.0, vocab_size_per_layer_input=len(tok),
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
    kw.update(CONFIGS[name])
    kw["num_hidden_layers"] = len(kw["layer_types"])
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**kw)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "scale" in pname:
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.15)
        for bname, b in model.named_buffers():
            if bname.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(folder)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own generate, greedy, EOS ignored."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()
