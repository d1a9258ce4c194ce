"""Engine configuration: one dataclass shared by the Python API, the CLI and the server."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint folder; None means the built-in demo model
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # CPU budget; default 1 GiB
    gpu_memory_utilization: float = 0.85  # GPU budget: fraction of free memory
    num_kv_blocks: int | None = None  # overrides the budget (tests)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    load_format: str = "auto"  # auto | dummy
    enforce_eager: bool = False
    seed: int = 0
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False  # token-id prompts only, no text out (benchmarks)
    extra: dict = field(default_factory=dict)

    def resolved_model(self) -> str:
        return str(self.model) if self.model else str(DEMO_MODEL_DIR)


_HELP = {
    "model": "checkpoint folder in Hugging Face layout (default: the built-in demo model)",
    "tokenizer": "tokenizer folder (default: the model folder)",
    "device": "cpu or cuda",
    "dtype": "weights and activations dtype: auto (the checkpoint's), float32, bfloat16, float16",
    "max_model_len": "longest prompt + output in tokens (default: the model's max_position_embeddings)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "per-step token budget; prompts longer than this are prefilled in chunks",
    "block_size": "tokens per KV-cache block",
    "kv_cache_memory_bytes": "KV-cache budget in bytes (CPU; default 1 GiB)",
    "gpu_memory_utilization": "fraction of free GPU memory given to the KV cache",
    "num_kv_blocks": "exact number of KV-cache blocks (overrides the budget)",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes across requests",
    "enable_chunked_prefill": "split long prompts across steps",
    "load_format": "auto (safetensors) or dummy (random weights of the right shapes)",
    "enforce_eager": "run the model in eager mode: no torch.compile, no CUDA Graphs",
    "seed": "seed for dummy weights and unseeded sampling",
    "trust_remote_code": "accepted for vLLM compatibility; remote code is never run",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids and outputs carry no text",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per EngineConfig field (--max-model-len, --enable-prefix-caching / --no-..., ...)."""
    for f in fields(EngineConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.type in ("bool", bool):
            parser.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=_HELP[f.name])
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
        parser.add_argument(flag, type=kind, default=default, help=f"{_HELP[f.name]} (default: {default})")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**values)
