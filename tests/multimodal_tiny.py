"""A tiny random Gemma4ForConditionalGeneration (vision + audio towers) with its own processor: the oracle
for the multimodal path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tiny_models import TEXT

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|image|>", "<|audio|>", "<|video|>", "<boi>", "<eoi>", "<boa>",
            "<eoa>"]
IMAGE, AUDIO, VIDEO, BOI, EOI, BOA, EOA = range(4, 11)


def make_mm_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer)
    tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<|image|>", "audio_token": "<|audio|>", "boi_token": "<boi>",
                              "eoi_token": "<eoi>", "boa_token": "<boa>", "eoa_token": "<eoa>"})
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'text' %}{{ p['text'] }}{% elif p['type'] == 'image' %}<|image|>"
        "{% elif p['type'] == 'audio' %}<|audio|>{% elif p['type'] == 'video' %}<|video|>{% endif %}"
        "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<model>{% endif %}"
    )
    return fast


def make_processor(folder: Path, tok):
    from transformers import Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    proc = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70),
        tokenizer=tok,
        video_processor=Gemma4VideoProcessor(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70, num_frames=2),
        chat_template=tok.chat_template, image_seq_length=70)
    proc.save_pretrained(folder)
    tok.save_pretrained(folder)
    return proc


def make_mm_checkpoint(folder: Path, seed: int = 0, audio: bool = True):
    """Saves tokenizer, processor and a random Gemma4ForConditionalGeneration; returns (hf model, processor)."""
    from transformers import (Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig,
                              Gemma4VisionConfig)

    folder.mkdir(parents=True, exist_ok=True)
    tok = make_mm_tokenizer(folder)
    proc = make_processor(folder, tok)
    text = Gemma4TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                            layer_types=["sliding_attention", "full_attention"] * 2,
                            hidden_size_per_layer_input=8, vocab_size_per_layer_input=len(tok), sliding_window=16,
                            eos_token_id=1, pad_token_id=0, use_bidirectional_attention="vision",
                            max_position_embeddings=512)
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                                standardize=True)
    audio_cfg = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32,
                                  subsampling_conv_channels=[128, 4]) if audio else None
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=audio_cfg, image_token_id=IMAGE,
                       audio_token_id=AUDIO, video_token_id=VIDEO, boi_token_id=BOI, eoi_token_id=EOI,
                       boa_token_id=BOA, eoa_token_index=EOA)
    torch.manual_seed(seed)
    hf = Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.normal_(1.0, 0.3)
            elif "language_model" in name or "embed_" in name:
                p.normal_(0.0, 0.15)
        vt = hf.model.vision_tower
        vt.std_bias.normal_(0.0, 0.1)
        vt.std_scale.uniform_(0.5, 1.5)
    hf.save_pretrained(folder)
    return hf, proc


def image(seed: int, h: int = 40, w: int = 56):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def audio_clip(seed: int, seconds: float = 0.3, rate: int = 16_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t) + 0.1 * rng.standard_normal(t.size)).astype(np.float32)


def video_clip(seed: int, frames: int = 2, h: int = 32, w: int = 32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.random((frames, h, w, 3)) * 255).astype("uint8")
