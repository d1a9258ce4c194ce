"""Build the tiny built-in demo model served when no model is given.

Trains a byte-level BPE tokenizer and a tiny Gemma 4 text model on English text
shipped with the Python standard library (pydoc help topics + stdlib docstrings),
then saves both to compiled_llm/demo_model/.  No downloads; CPU only.

    python scripts/make_demo_model.py [--out DIR] [--steps N] [--seed S]
"""

import argparse
import ast
import math
import pathlib
import sysconfig
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
VOCAB_SIZE = 6144

# Gemma-style chat template; a system message is folded into the first user turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] | trim + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}{% if loop.first %}{{ system }}{% endif %}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def gather_text():
    """English text from the stdlib: pydoc help topics and docstrings (parsed, not imported)."""
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)]
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip", "tkinter"}
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80:
                    # drop doctest lines, they are code rather than prose
                    lines = [l for l in doc.splitlines() if not l.lstrip().startswith((">>>", "..."))]
                    docs.append("\n".join(lines))
    return docs


def build_tokenizer(docs):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,  # ids 0..5 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    # prepend <bos> when add_special_tokens=True
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
    )
    assert [tok.token_to_id(s) for s in SPECIALS[:4]] == [0, 1, 2, 3]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[4:],
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer):
    vocab = len(tokenizer)
    config = Gemma4TextConfig(
        vocab_size=vocab,
        hidden_size=160,
        intermediate_size=384,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # sliding layers
        global_head_dim=64,  # full layers (stored in per_layer_config)
        num_global_key_value_heads=1,
        attention_k_eq_v=True,  # full layers reuse k_proj output as values
        hidden_size_per_layer_input=16,  # per-layer embeddings (PLE)
        vocab_size_per_layer_input=vocab,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Gemma4ForCausalLM(config)


def token_stream(tokenizer, docs):
    """All documents tokenized (no <bos>), each followed by <eos>, as one long tensor."""
    ids = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids + [tokenizer.eos_token_id])
    return torch.tensor(ids, dtype=torch.long)


def batch_of(data, bos_id, gen, batch, seq_len=128):
    """Random windows of the token stream, each starting with <bos> like a real prompt."""
    offs = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
    x = torch.stack([data[o : o + seq_len - 1] for o in offs])
    return torch.cat([torch.full((batch, 1), bos_id), x], dim=1)


def train(model, data, bos_id, steps, seq_len=128, batch=16, lr=3e-3, warmup=50):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    # linear warmup, cosine decay to 10% of lr
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (s + 1) / warmup if s < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))),
    )
    model.train()
    start, ema = time.time(), None
    for step in range(steps):
        x = batch_of(data, bos_id, None, batch, seq_len)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  ema {ema:.3f}  lr {sched.get_last_lr()[0]:.2e}  {time.time() - start:6.0f}s", flush=True)
    model.eval()
    return ema


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="compiled_llm/demo_model")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    docs = gather_text()
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} MB of text")
    tokenizer = build_tokenizer(docs)
    data = token_stream(tokenizer, docs)
    print(f"tokenizer: {len(tokenizer)} tokens; corpus = {len(data)} tokens")

    model = build_model(tokenizer)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    ema = train(model, data, tokenizer.bos_token_id, args.steps)
    print(f"final loss (ema): {ema:.3f}")

    # save in bfloat16 if it costs (almost) nothing in loss on a fixed batch
    x = batch_of(data, tokenizer.bos_token_id, torch.Generator().manual_seed(1234), 32)
    with torch.no_grad():
        loss32 = model(input_ids=x, labels=x).loss.item()
        model.to(torch.bfloat16)
        loss16 = model(input_ids=x, labels=x).loss.item()
    print(f"eval loss: float32 {loss32:.3f}, bfloat16 {loss16:.3f}")
    if loss16 > loss32 + 0.05:
        model.to(torch.float32)

    out = pathlib.Path(args.out)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=0.8,
        top_k=50,
        top_p=0.95,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved to {out} ({size / 1e6:.2f} MB)")

    # reload through the Auto classes and sample with transformers' own generate
    AutoConfig.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    lm = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    enc = tok("Once upon a time", return_tensors="pt")
    assert enc.input_ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        gen = lm.generate(**enc, max_new_tokens=30, do_sample=False)
    print("sample:", repr(tok.decode(gen[0], skip_special_tokens=True)))


if __name__ == "__main__":
    main()
