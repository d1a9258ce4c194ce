"""Tiny random Qwen3.5 checkpoints (dense, MoE, conditional generation) built with transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_models import make_tokenizer

LIN, FULL = "linear_attention", "full_attention"

# name -> (architecture, text-config overrides)
CONFIGS: dict[str, tuple[str, dict]] = {
    "dense": ("Qwen3_5ForCausalLM", dict(layer_types=[LIN, FULL, LIN, LIN, FULL])),
    "moe": ("Qwen3_5MoeForCausalLM", dict(layer_types=[LIN, LIN, FULL, LIN], num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=24, shared_expert_intermediate_size=32)),
    # ForConditionalGeneration checkpoints (vision tower saved, skipped by us); tied embeddings; other head shapes
    "dense_vl": ("Qwen3_5ForConditionalGeneration",
                 dict(layer_types=[FULL, LIN, LIN, FULL], tie_word_embeddings=True, linear_num_key_heads=4,
                      linear_value_head_dim=16, linear_conv_kernel_dim=3)),
    "moe_vl": ("Qwen3_5MoeForConditionalGeneration",
               dict(layer_types=[LIN, FULL, LIN], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=24, tie_word_embeddings=True)),
}

# head_dim 32, the smallest the Triton attention kernel takes: with it a GPU run engages whole-graph decode
# (scripts/gpu_smoke.py qwen_dense32, qwen_moe32); M-RoPE's sections cover the wider rotary part
_ROPE32 = dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.5, mrope_section=[4, 2, 2],
               mrope_interleaved=True)
WIDE: dict[str, tuple[str, dict]] = {f"{name}32": (CONFIGS[name][0], dict(CONFIGS[name][1], head_dim=32,
                                                                           rope_parameters=_ROPE32))
                                     for name in ("dense", "moe")}

VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, num_position_embeddings=16)


def _build(arch: str, text: dict, special: dict | None = None):
    import transformers as tf

    if arch == "Qwen3_5ForCausalLM":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text))
    if arch == "Qwen3_5MoeForCausalLM":
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text))
    tie = text.pop("tie_word_embeddings", False)
    vision = dict(VISION, out_hidden_size=text["hidden_size"])
    v = text["vocab_size"]  # special vision tokens inside the tiny vocabulary
    special = special or dict(image_token_id=v - 1, video_token_id=v - 2, vision_start_token_id=v - 3,
                              vision_end_token_id=v - 4)
    if arch == "Qwen3_5ForConditionalGeneration":
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie, **special)
        return tf.Qwen3_5ForConditionalGeneration(cfg)
    cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **special)
    return tf.Qwen3_5MoeForConditionalGeneration(cfg)


def make_qwen_checkpoint(folder: Path, name: str, seed: int = 0, dtype=torch.float32, special: dict | None = None,
                         vocab: int | None = None):
    """Saves a random transformers model (norms, A_log, dt_bias, conv and gates randomised too).
    special: vision token ids of a conditional-generation model; vocab: a tokenizer of that size is saved already."""
    arch, overrides = CONFIGS[name] if name in CONFIGS else WIDE[name]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = vocab or len(make_tokenizer(folder))
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                rope_parameters=dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.5,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
    text.update(overrides)
    text["num_hidden_layers"] = len(text["layer_types"])
    torch.manual_seed(seed)
    model = _build(arch, dict(text), special).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "visual" in pname:
                p.normal_(0.0, 0.1) if "norm" not in pname else p.normal_(1.0, 0.1)
                continue
            if pname.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.3)  # plain-scale norm
            elif "norm" in pname:
                p.normal_(0.0, 0.3)  # zero-centred norms: scale is 1 + weight
            elif pname.endswith("A_log"):
                p.uniform_(-1.0, 1.5)
            elif pname.endswith("dt_bias"):
                p.normal_(0.0, 1.0)
            elif "conv1d" in pname:
                p.normal_(0.0, 0.4)
            else:
                p.normal_(0.0, 0.15)
    model.to(dtype).save_pretrained(folder)
    return model


# ---- with a processor: the oracle for image / video prompts ----------------------------------------

VL_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
               "<|vision_end|>"]
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = range(4, 8)


def make_vl_processor(folder: Path):
    """A Qwen3-VL processor built offline: a tiny BPE tokenizer with the vision special tokens, the
    Qwen2-VL image processor and the Qwen3-VL video processor (patch 4, 2x2 merge, small pixel budgets)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from tiny_models import TEXT

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=VL_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'text' %}{{ p['text'] }}"
        "{% elif p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif p['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% endif %}"
        "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<model>{% endif %}"
    )
    pixels = dict(patch_size=4, temporal_patch_size=2, merge_size=2)
    proc = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size={"shortest_edge": 256, "longest_edge": 2048}, **pixels),
        video_processor=Qwen3VLVideoProcessor(size={"shortest_edge": 256, "longest_edge": 4096},
                                              do_sample_frames=False, cap_pixels_per_frame=True, **pixels),
        tokenizer=fast, chat_template=fast.chat_template)
    proc.save_pretrained(folder)
    fast.save_pretrained(folder)
    return proc


def make_qwen_vl_checkpoint(folder: Path, name: str = "dense_vl", seed: int = 0):
    """A random Qwen3_5(Moe)ForConditionalGeneration whose tokenizer/processor hold the vision tokens;
    returns (hf model, processor)."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = make_vl_processor(folder)
    special = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                   vision_end_token_id=VISION_END)
    return make_qwen_checkpoint(folder, name, seed, special=special, vocab=len(proc.tokenizer)), proc
