"""Sparse-KV methods for long contexts, on the runtime side: StreamingLLM and OmniKV (docs/sparse_kv.md).

`SparseKV.build(config, specs, device)` checks the method's parameters against the model (one-line
ValueErrors), marks the full-attention layers' AttentionSpecs (the attention op reads them, see
ops/sparse.py), and then, each step, builds the SparseMetadata the op reads and counts, per sequence,
the tokens the method's layers attended to against the tokens they keep cached.

- StreamingLLM: each full-attention layer becomes a window of `sparse_window` tokens plus
  `sparse_sink_tokens` attention sinks; its KV group (window, sinks) releases the blocks between the
  sinks and the window, so a sequence's cache is bounded however long it runs.
- OmniKV: decode steps of the full-attention layers after the first filter layer attend to the
  `omnikv_budget` tokens the last filter layer picked; the full cache is kept, the sparse layers' part of it
  in pinned host memory by default on CUDA (`omnikv_offload`; the GPU reads it at the picked tokens only, and
  a prefill chunk's context is brought over once a layer), so the GPU holds only the filter and dense layers'.
Sliding-window layers keep their own window under both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from compiled_llm.ops.sparse import SparseMetadata, index_buffer, staging_buffer

log = logging.getLogger("compiled_llm")

METHODS = ("streamingllm", "omnikv")


@dataclass(frozen=True)
class SparseKVConfig:
    method: str
    sink_tokens: int
    window: int  # StreamingLLM
    filter_layers: tuple[int, ...] | None  # OmniKV; None: the first full-attention layer
    budget: int  # OmniKV
    recent: int  # OmniKV
    offload: bool = False  # OmniKV: the sparse layers' KV in pinned host memory
    host_memory_bytes: int | None = None  # its cap (None: a share of the host's available memory)

    @classmethod
    def from_engine_config(cls, config) -> "SparseKVConfig | None":
        """The method's parameters, checked on their own (before the model is built). None: no method."""
        method = config.sparse_method
        if method is None or method == "" or str(method).lower() in ("none", "dense"):
            return None
        method = str(method).lower()
        if method not in METHODS:
            raise ValueError(f"sparse_method must be one of {', '.join(METHODS)} (got {config.sparse_method!r})")
        sinks, window = config.sparse_sink_tokens, config.sparse_window
        budget, recent = config.omnikv_budget, config.omnikv_recent
        if sinks < 0:
            raise ValueError(f"sparse_sink_tokens must be >= 0 (got {sinks})")
        filters = None
        if method == "streamingllm" and window < 1:
            raise ValueError(f"sparse_window must be >= 1 (got {window})")
        if method == "omnikv":
            if recent < 1:
                raise ValueError(f"omnikv_recent must be >= 1: the current token is always kept (got {recent})")
            if budget <= sinks + recent:
                raise ValueError(f"omnikv_budget ({budget}) must exceed sparse_sink_tokens + omnikv_recent "
                                 f"({sinks} + {recent}) to leave room for selected tokens")
            if getattr(config, "pipeline_parallel_size", 1) > 1:
                raise ValueError("sparse_method omnikv does not run with pipeline parallelism: a stage's sparse "
                                 "layers would need the token choice of a filter layer on another stage")
            filters = parse_layers(config.omnikv_filter_layers)
        elif config.omnikv_filter_layers:
            raise ValueError("omnikv_filter_layers is set but sparse_method is not omnikv")
        offload, host = _offload_choice(config, method)
        return cls(method, sinks, window, filters, budget, recent, offload, host)


def _offload_choice(config, method: str) -> tuple[bool, int | None]:
    """(offload, host byte cap). Default: on for OmniKV on CUDA in one process; asked for explicitly, it also
    runs on the CPU (where host and device memory are one: only the KV plan changes)."""
    offload, gb = getattr(config, "omnikv_offload", None), getattr(config, "omnikv_host_memory_gb", None)
    if method != "omnikv":
        if offload or gb is not None:
            raise ValueError("omnikv_offload and omnikv_host_memory_gb apply to sparse_method omnikv only")
        return False, None
    if gb is not None and not gb > 0:
        raise ValueError(f"omnikv_host_memory_gb must be > 0 (got {gb})")
    single = getattr(config, "tensor_parallel_size", 1) == 1
    if offload is None:
        offload = str(config.device).startswith("cuda") and single
    elif offload and not single:
        raise ValueError("omnikv_offload runs in one process only (not checked under tensor parallelism yet); "
                         "use --no-omnikv-offload")
    if gb is not None and not offload:
        raise ValueError("omnikv_host_memory_gb is set but the KV is not offloaded (--no-omnikv-offload)")
    return bool(offload), (int(gb * 2 ** 30) if gb is not None else None)


def parse_layers(text) -> tuple[int, ...] | None:
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    try:
        items = text if isinstance(text, (list, tuple)) else str(text).split(",")
        layers = tuple(sorted({int(str(x).strip()) for x in items if str(x).strip()}))
    except ValueError:
        raise ValueError(f"omnikv_filter_layers must be comma-separated layer indices (got {text!r})") from None
    return layers or None


class SparseKV:
    def __init__(self, cfg: SparseKVConfig, specs: dict, device: torch.device, max_rows: int, block_size: int,
                 tp_group_name: str | None = None, one_stage_of_several: bool = False):
        self.cfg = cfg
        self.block_size = block_size
        self.max_rows = max_rows
        self.method = cfg.method
        self.specs = specs
        self.device = device
        self.tp_group_name = tp_group_name
        full = sorted(i for i, s in specs.items() if s.sliding_window is None)
        if not full and not one_stage_of_several:  # a pipeline stage may hold sliding layers only
            raise ValueError(f"sparse_method {cfg.method} applies to full-attention layers and this model has none")
        self.layers = full  # the layers the method applies to
        self.roles: dict[int, str | None] = {}
        self.offloaded: list[int] = []  # OmniKV offload: layers whose cache lives in pinned host memory
        if cfg.method == "streamingllm":
            if cfg.sink_tokens:
                missing = [i for i in full if specs[i].inv_freq is None]
                if missing:
                    raise ValueError(f"streamingllm re-positions its sink tokens with the layers' rope, which layer "
                                     f"{missing[0]} of this model does not declare; use sparse_sink_tokens=0")
            for i in full:
                specs[i].sliding_window = cfg.window
                specs[i].sink_tokens = cfg.sink_tokens
        else:
            filters = cfg.filter_layers or (full[0],)
            bad = [i for i in filters if i not in full]
            if bad:
                raise ValueError(f"omnikv_filter_layers: layer {bad[0]} is not a full-attention layer of this model "
                                 f"(full-attention layers: {', '.join(map(str, full))})")
            for i in full:
                self.roles[i] = "filter" if i in filters else ("sparse" if i > filters[0] else None)
                specs[i].omnikv = self.roles[i]
            # offload: the caches only sparse layers read (a cache a filter or dense layer shares stays)
            readers: dict[int, list[int]] = {}
            for j, sp in specs.items():
                readers.setdefault(sp.cache_layer, []).append(j)
            self.offloaded = [i for i in full if cfg.offload and specs[i].writes_cache
                              and all(self.roles.get(j) == "sparse" for j in readers[i])]
            for i in self.offloaded:
                specs[i].offloaded = True
            # the fixed-size index buffer the filter layers write and the sparse layers read (CUDA Graphs)
            index_buffer(max_rows, cfg.budget, device)
        self.attended_total = 0
        self.cached_total = 0
        self.offloaded_bytes = 0  # set by the runner once the offloaded caches are allocated
        self.staging: dict[int, torch.Tensor] = {}  # offloaded cache layer -> its staging buffer (allocate_staging)

    def allocate_staging(self, dtype: torch.dtype) -> int:
        """OmniKV offload: the device buffers each offloaded cache's picks are staged in for its sparse layers
        (max_rows x budget tokens each; ops/sparse.staging_buffer), allocated before the memory profile so
        that the KV cache's budget is what is left after them. Returns their bytes."""
        for i in self.offloaded:
            s = self.specs[i]
            self.staging[i] = staging_buffer(self.max_rows, self.cfg.budget, 1 if s.k_eq_v else 2, s.num_kv_heads,
                                             s.head_dim, dtype, self.device)
        return self.staging_bytes

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.staging.values())

    @classmethod
    def build(cls, config, specs: dict, device: torch.device) -> "SparseKV | None":
        cfg = SparseKVConfig.from_engine_config(config)
        if cfg is None:
            return None
        from compiled_llm.distributed.parallel_state import get_parallel_state

        state = get_parallel_state()
        tp_name = state.tp_group_name if state.tp_size > 1 else None
        out = cls(cfg, specs, device, config.max_num_seqs, config.block_size, tp_name, state.pp_size > 1)
        log.info("sparse KV: %s", out.describe())
        return out

    def describe(self) -> str:
        c = self.cfg
        if self.method == "streamingllm":
            return (f"streamingllm on layers {self.layers}: {c.sink_tokens} sink tokens + a window of {c.window}")
        roles = {r: [i for i, x in self.roles.items() if x == r] for r in ("filter", "sparse")}
        where = f"KV of layers {self.offloaded} in pinned host memory" if self.offloaded else "all KV on the device"
        return (f"omnikv: filter layers {roles['filter']}, sparse layers {roles['sparse']}, budget {c.budget} "
                f"({c.sink_tokens} sink + {c.recent} recent always kept); {where}")

    @property
    def hash_generated_blocks(self) -> bool:
        """Whether blocks holding generated tokens may serve prefix hits (not under OmniKV: their KV came
        from sparse decode steps, which a prefill of the same tokens would not reproduce)."""
        return self.method != "omnikv"

    # ---- per step ----------------------------------------------------------------------------
    def metadata(self, batch, count: bool = True) -> SparseMetadata:
        """batch: ScheduledSeq items. A row is a decode row when it computes one token past the prompt."""
        decode = [item.is_decode for item in batch]
        if count:
            for item, d in zip(batch, decode):
                if d:
                    self._count(item.seq, item.seq.num_computed_tokens + 1)
        return self.decode_metadata(decode)

    def decode_metadata(self, decode: list[bool]) -> SparseMetadata:
        """The metadata for rows with these decode flags (CUDA-graph capture: all True)."""
        c = self.cfg
        return SparseMetadata(decode=decode, budget=c.budget, sink=c.sink_tokens, recent=c.recent,
                              tp_group_name=self.tp_group_name, staging=self.staging)

    @property
    def index(self) -> torch.Tensor | None:
        """OmniKV: the token choice of the last filter layer, one row per sequence of the last step."""
        return index_buffer(0, self.cfg.budget, self.device) if self.method == "omnikv" else None

    def decode_workspace_bytes(self, rows: int, max_model_len: int) -> int:
        """Device memory a decode step of `rows` sequences takes beyond the weights and the KV cache, over the
        prefill step the start-up profiles: OmniKV's filter layer keeps each key's score per head and the
        heads' summed probabilities ([rows, heads, width] and [rows, width] float32, width the block-table
        width in tokens), and the top-k's copies of the latter (~3 more). StreamingLLM: 0."""
        if self.method != "omnikv":
            return 0
        width = -(-max_model_len // self.block_size) * self.block_size
        heads = max(self.specs[i].num_heads for i in self.layers if self.roles[i] == "filter")
        return rows * width * 4 * (heads + 4)

    def tokens_per_layer(self, context_len: int, block_size: int) -> list[tuple[int, int]]:
        """(attended, cached) for each layer the method applies to, for a decode query whose context
        (itself included) is context_len tokens."""
        L, c = context_len, self.cfg
        if self.method == "streamingllm":
            sink_held = min(L, -(-c.sink_tokens // block_size) * block_size)
            first = max(0, L - c.window) // block_size * block_size
            cached = sink_held + max(0, L - max(first, sink_held))
            return [(min(L, c.sink_tokens + c.window), cached)] * len(self.layers)
        return [(min(L, c.budget) if self.roles[i] == "sparse" else L, L) for i in self.layers]

    def _count(self, seq, context_len: int) -> None:
        att = cached = 0
        for a, k in self.tokens_per_layer(context_len, self.block_size):
            att += a
            cached += k
        seq.sparse_attended_tokens += att
        seq.sparse_cached_tokens += cached
        self.attended_total += att
        self.cached_total += cached

    def stats(self) -> dict:
        out = {"sparse_method": self.method, "sparse_attended_tokens": self.attended_total,
               "sparse_cached_tokens": self.cached_total}
        if self.method == "omnikv":  # the KV in pinned host memory instead of on the device
            out["omnikv_offloaded_kv_bytes"] = self.offloaded_bytes
            out["omnikv_staging_bytes"] = self.staging_bytes
        return out
