"""Engine configuration: one dataclass shared by the Python API, the CLI and the server."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; other names are checked and kept. Done once, when
    the config is made, so every later decision (backend, rank devices, memory plan) reads the real device:
    a GPU machine must never build a model on the CPU just because nobody passed --device."""
    import torch  # here, not at the top: config.py stays importable without loading torch (CLI --help)

    name = str(device).strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"  # the runner logs the device it builds on
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA GPU; use --device auto or cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} was asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
    return name


def default_batched_tokens(device: str) -> int:
    """The per-step token budget when none is given: 8192 on a GPU, 2048 on the CPU."""
    return 8192 if str(device).startswith("cuda") else 2048


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint folder; None means the built-in demo model
    tokenizer: str | None = None
    device: str = "auto"  # auto (cuda when a GPU is visible, else cpu) | cpu | cuda | cuda:N; resolved on creation
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    allow_long_max_model_len: bool = False  # max_model_len past the checkpoint's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # per-step token budget (chunked prefill); None: 8192 on CUDA (as
    # vLLM's and SGLang's servers on an H200: a MoE prefill chunk reads every expert, so fewer, larger chunks),
    # 2048 on the CPU
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # CPU budget; default 1 GiB
    gpu_memory_utilization: float = 0.9  # fraction of the GPU's total memory this engine may use (as vLLM)
    num_kv_blocks: int | None = None  # overrides the budget (tests)
    enable_prefix_caching: bool = True
    prefix_state_snapshots: int | None = None  # hybrid models: state snapshots kept for prefix hits; None: max_num_seqs
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority (each request's priority, lower first; vLLM's)
    # K=V layers whose rope rotates part of each half (Gemma 4's global layers) also keep those dims' rotated keys
    # in the cache: the decode kernel reads them instead of rebuilding (H200: the layer's decode -28%), at +25% of
    # those layers' KV (AttentionSpec.rot_keys; COMPILED_LLM_KV_ROT_KEYS=0 also turns it off)
    kv_rotated_keys: bool = True
    load_format: str = "auto"  # auto | dummy
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # launch step N+1 before step N's tokens reach the host; None: on on
    # CUDA, one process or tensor parallel (697 -> 770 tok/s on one H200), off where it cannot overlap (CPU) or
    # run (pipeline parallel, sparse KV)
    # compiler (docs/compiler.md); ignored with enforce_eager
    compile_cache: str | None = None  # folder of precompiled artefacts (python -m compiled_llm compile-cache)
    jit_monitor: str = "off"  # off | warn | error: what a JIT compile after start-up warm-up does
    cudagraph_batch_sizes: str | None = None  # "1,2,4,8"; None: powers of two up to max_num_seqs on CUDA and
    # prompt sizes 256 / 512 / 1024 (compiler PREFILL_CUDA_SIZES, within the token budget), none on CPU
    compile_sizes: str | None = None  # buckets with their own static compile; None or "none": none (every bucket
    # replays the dynamic compile: on the H200 cold start 99 -> 59 s, warm 23.5 -> 18.6 s, decode no slower);
    # "all": every bucket; "1,8": those
    full_graph_decode: str = "auto"  # auto | on | off: capture decode whole (attention included) where faster
    split_graph: str = "auto"  # auto | on | off: compile pieces between the attention ops (auto: on CUDA)
    max_autotune: str = "off"  # off | static | all: Inductor times Triton GEMM templates against cuBLAS per shape
    compile_passes: str | None = None  # comma-separated fusion passes; None: all that apply; "none": no fusion
    fusion_check: str = "warn"  # warn | error: what a layer missing a declared fusion does (compiler/verify.py)
    op_providers: str | None = None  # override the op resolver: "attention=reference,rms_norm=triton"
    seed: int = 0
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False  # token-id prompts only, no text out (benchmarks)
    # parallelism (README "Parallelism"): one process per rank, rank 0 is the engine's own
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: experts split across the tensor-parallel ranks
    tp_allreduce: str = "nccl"  # nccl | symm-mem: how the compiled pieces all-reduce small (decode) tensors
    distributed_backend: str = "auto"  # auto (nccl on cuda, gloo on cpu) | nccl | gloo
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node) or 29500 (several nodes)
    nnodes: int = 1
    node_rank: int = 0
    # sparse KV for long contexts (docs/sparse_kv.md): None | "streamingllm" | "omnikv"
    sparse_method: str | None = None
    sparse_sink_tokens: int = 4
    sparse_window: int = 1024  # StreamingLLM
    omnikv_filter_layers: str | None = None  # "5,17"; default: the first full-attention layer
    omnikv_budget: int = 1024
    omnikv_recent: int = 64
    # OmniKV: the sparse layers' full KV in pinned host memory (the GPU reads the picked tokens through its
    # mapping); None: on for a CUDA engine in one process
    omnikv_offload: bool | None = None
    omnikv_host_memory_gb: float | None = None  # the host KV's cap; None: 80% of the host's available memory
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.device = resolve_device(self.device)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_batched_tokens(self.device)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], not {self.gpu_memory_utilization}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, not {self.scheduling_policy!r}")
        if self.split_graph not in ("auto", "on", "off"):
            raise ValueError(f"split_graph must be auto, on or off, not {self.split_graph!r}")
        if self.tp_allreduce not in ("nccl", "symm-mem"):
            raise ValueError(f"tp_allreduce must be nccl or symm-mem, not {self.tp_allreduce!r}")
        if self.tp_allreduce == "symm-mem" and not (self.device.startswith("cuda") and self.tensor_parallel_size > 1
                                                    and not self.enforce_eager):
            raise ValueError("tp_allreduce symm-mem needs CUDA, tensor_parallel_size > 1 and the compiler (not "
                             "enforce_eager): it is how the compiled pieces all-reduce")

    def resolved_model(self) -> str:
        return str(self.model) if self.model else str(DEMO_MODEL_DIR)


_ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"]}

_HELP = {
    "model": "checkpoint folder in Hugging Face layout (default: the built-in demo model)",
    "tokenizer": "tokenizer folder (default: the model folder)",
    "device": "auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N",
    "dtype": "weights and activations dtype: auto (the checkpoint's), float32, bfloat16, float16",
    "max_model_len": "longest prompt + output in tokens (default: the model's max_position_embeddings)",
    "allow_long_max_model_len": "accept a --max-model-len longer than the checkpoint's max_position_embeddings "
                                "(outputs past the trained context may be garbage; as vLLM's "
                                "VLLM_ALLOW_LONG_MAX_MODEL_LEN)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "per-step token budget; prompts longer than this are prefilled in chunks "
                              "(default 8192 on a GPU, 2048 on the CPU)",
    "block_size": "tokens per KV-cache block",
    "kv_cache_memory_bytes": "KV-cache budget in bytes (CPU; default 1 GiB)",
    "gpu_memory_utilization": "fraction of the GPU's total memory this engine may use: weights, the activations "
                              "of a max-num-batched-tokens step (measured at start-up), CUDA graphs and the "
                              "sampler come out of it, the KV cache gets the rest (as vLLM)",
    "num_kv_blocks": "exact number of KV-cache blocks (overrides the budget)",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes across requests",
    "kv_rotated_keys": "K=V layers whose rope rotates only part of each head (Gemma 4's global layers) keep those "
                       "dims' rotated keys beside each cached value: a faster decode for 25%% more of those "
                       "layers' KV memory (--no-kv-rotated-keys: more context in the same memory)",
    "prefix_state_snapshots": "models with recurrent (linear-attention) layers: how many recurrent-state snapshots "
                              "at block boundaries the prefix cache keeps (each as large as one sequence's state, "
                              "taken from the KV-cache budget; default max-num-seqs; 0 turns prefix caching off "
                              "for such models)",
    "enable_chunked_prefill": "split long prompts across steps",
    "scheduling_policy": "fcfs (arrival order; the latest admitted is preempted first) or priority (each request's "
                         "priority, lower first, then arrival: admission, the step's token budget and preemption, "
                         "which takes the lowest-priority running request first; as vLLM's)",
    "load_format": "auto (safetensors) or dummy (random weights of the right shapes)",
    "enforce_eager": "run the model in eager mode: no torch.compile, no CUDA Graphs",
    "async_scheduling": "prepare and launch each step while the previous one still runs on the device; its "
                        "tokens are read one step later (one process or tensor parallel; requests with penalties "
                        "step synchronously). Default: on for a CUDA engine without pipeline parallel or a sparse "
                        "KV method, else off",
    "compile_cache": "folder of precompiled compiler artefacts (build it with `compile-cache`); a stale or corrupt "
                     "cache is rebuilt there, with a warning",
    "jit_monitor": "off, warn or error: what a JIT compile after start-up warm-up does (error: raise)",
    "cudagraph_batch_sizes": "comma-separated token counts compiled statically and captured as CUDA Graphs "
                             "(default on CUDA: powers of two up to max-num-seqs, then 256, 512 and 1024 for "
                             "prompts, within max-num-batched-tokens; none on CPU; 'none' for none)",
    "max_autotune": "matmuls of the compiled pieces timed on this device (Inductor's Triton GEMM templates "
                    "against cuBLAS) and the fastest kept: off, static (the static batch sizes: decode) or all "
                    "(the dynamic compile too); slower start-up, kept in the compile cache",
    "compile_sizes": "comma-separated batch sizes (of --cudagraph-batch-sizes) that get their own static "
                     "Inductor compile; the other sizes replay the dynamic-token-count compile, padded (and "
                     "captured as CUDA Graphs). Default 'none': every size replays the dynamic compile (the fastest "
                     "start, and on the H200 no slower a decode step); 'all': each size its own compile",
    "full_graph_decode": "auto, on or off: capture decode steps as one CUDA Graph, attention included, when the "
                         "attention kernels allow it (auto: only where measured faster than piecewise graphs)",
    "split_graph": "auto, on or off: split the compiled forward at the attention and recurrent-state ops and compile "
                   "the pieces between them (each piece its own CUDA Graph). auto: on on CUDA, off on the CPU (one "
                   "compiled graph that calls those ops: less Python a step); off on CUDA needs "
                   "--cudagraph-batch-sizes none",
    "compile_passes": "comma-separated fusion passes to run (add_rms_norm, qk_norm_rope_kv_write, "
                      "allreduce_rms_norm, router_topk, geglu_moe, swiglu_moe, moe_overlap (CUDA: the routed experts on "
                      "a side stream), skinny_mm (CUDA: decode's narrow projections in one launch); default: all "
                      "that apply; 'none': no fusion)",
    "fusion_check": "warn or error: what a compiled layer that missed a fusion its model declares does (a MoE "
                    "layer that would run every expert on every token is always an error)",
    "op_providers": "override the op provider resolver, e.g. 'attention=reference,rms_norm=triton'",
    "seed": "seed for dummy weights and unseeded sampling",
    "trust_remote_code": "accepted for vLLM compatibility; remote code is never run",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids and outputs carry no text",
    "tensor_parallel_size": "ranks that split every layer (attention heads, MLP, vocabulary)",
    "pipeline_parallel_size": "ranks that split the layer stack into consecutive stages",
    "enable_expert_parallel": "MoE models: give each tensor-parallel rank whole experts instead of a slice of each",
    "tp_allreduce": "tensor parallel on CUDA, compiled: nccl, or symm-mem (all-reduces up to 128 KB, i.e. decode, "
                    "as torch's symmetric-memory one-shot kernel, the producer writing straight into symmetric "
                    "memory; Inductor's lowering). Default: nccl",
    "distributed_backend": "torch.distributed backend: auto (nccl on cuda, gloo on cpu), nccl or gloo",
    "master_addr": "address of the node running rank 0 (several nodes)",
    "master_port": "port for the ranks' rendezvous (default: a free port on one node, 29500 on several)",
    "nnodes": "nodes taking part; each runs the same command with its own --node-rank",
    "node_rank": "this node's index; node 0 runs the engine (and the server), the others only workers",
    "sparse_method": "sparse KV for long contexts on the full-attention layers: streamingllm (attention sinks + "
                     "a recent window; bounded cache) or omnikv (decode attends to tokens picked by filter layers; "
                     "full cache kept)",
    "sparse_sink_tokens": "first tokens always kept (attention sinks), streamingllm and omnikv",
    "sparse_window": "streamingllm: recent tokens each full-attention layer keeps besides the sinks",
    "omnikv_filter_layers": "omnikv: comma-separated full-attention layers that pick the tokens for the layers "
                            "after them (default: the first full-attention layer)",
    "omnikv_budget": "omnikv: tokens a sparse layer attends to at each decode step, sinks and recent included",
    "omnikv_recent": "omnikv: most recent tokens always kept",
    "omnikv_offload": "omnikv: keep the sparse layers' KV in pinned host memory, read by the GPU only at the picked "
                      "tokens (more sequences fit; each decode step moves the picks over PCIe); --no-omnikv-offload "
                      "keeps all KV on the GPU. Default: on for a CUDA engine in one process",
    "omnikv_host_memory_gb": "omnikv with offload: the most host memory the offloaded KV may pin, in GiB (default: "
                             "80%% of the host's available memory)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per EngineConfig field (--max-model-len, --enable-prefix-caching / --no-..., ...)."""
    for f in fields(EngineConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.type in ("bool", bool, "bool | None"):
            parser.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=_HELP[f.name])
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
        text = _HELP[f.name]  # its default once: a help that states it in words gets no "(default: None)" too
        if default is not None and "default" not in text.lower():
            text += f" (default: {default})"
        parser.add_argument(*_ALIASES.get(f.name, []), flag, type=kind, default=default, help=text)


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**{**values, **overrides})
