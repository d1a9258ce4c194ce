"""CompiledModel: what the runtime calls instead of the model's forward when compiling.

One torch.compile (our backend) serves every token count: the token dimension is dynamic, and batch
sizes listed in the config run padded to the next listed size, through pieces compiled for that size
(and on CUDA, replayed CUDA Graphs). Decode batches may instead replay one graph of the whole forward,
attention included, when every attention layer's kernel can be captured and that measured faster.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from typing import Any

import torch
import torch.fx.experimental._config as fx_config

from compiled_llm.compiler import codegen
from compiled_llm.compiler.backend import Backend, CompilerConfig
from compiled_llm.compiler.cuda_graph import BatchDescriptor, CUDAGraphWrapper
from compiled_llm.compiler.direct import MISS, DirectForward
from compiled_llm.ops.context import GroupMetadata, get_forward_context, set_forward_context
from compiled_llm.ops.jit import MONITOR
from compiled_llm.ops.upload import new_step_inputs
from compiled_llm.passes.manager import PassManager

log = logging.getLogger("compiled_llm")

_NO_01_SPECIALISATION = {"backed_size_oblivious": True} if hasattr(fx_config, "backed_size_oblivious") else {}


def allow_many_engines() -> None:
    """Every engine in a process compiles the same forward code object (one Dynamo cache entry per model,
    two after a one-token recompile): raise Dynamo's per-code-object cap (8, meant to stop recompile loops in
    a training step) so that a process holding or creating several compiled engines (tests, notebooks, an
    API user comparing models) does not hit it."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 1024)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8192)


def skip_module_guards(entries) -> list[bool]:
    """Dynamo's guards to keep: none on the model's modules (their parameters' and buffers' tensor checks, their
    attributes), which no call of one engine changes; the inputs' and globals' stay. The model's ~80 tensors
    had cost ~0.27 ms a call in guard evaluation (torch 2.14's dimension-marking guards, five attribute lookups a
    tensor), 5% of a CPU decode step. Safe across engines: a cache entry is only used by the torch.compile
    (backend) that made it, which checks that apart from the guards."""
    return [not e.orig_guard.source.is_unspecialized_nn_module() for e in entries]


@dataclasses.dataclass
class RunState:
    bucket: int | None = None  # the static size this call runs at (None: dynamic)
    cudagraphs: bool = False
    pool: Any = None  # the memory pool every CUDA graph of the engine captures into

    def graph_pool(self):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool


def copy_grouped(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for each (dst, src) pair: one multi-tensor copy (`torch._foreach_copy_`, one launch on CUDA)
    for each group of two or more dense pairs, the rest one by one. A pair of one dtype whose elements are whole
    32-bit words (int64, int32, float32) is copied as int32 words, so a step's int64 ids, positions and slots go
    out in the same launch as its int32 lengths, offsets and block-table rows. A decode step's inputs are a dozen
    small device-to-device copies into the static buffers; one launch each cost ~2 us of the step's head on the
    H200 (session 31's batch-1 profile: eight of them), and one launch a dtype left three (session 55's H100
    batch-4 step: ~17 us from the first to the end of the last)."""
    groups: dict[tuple, list] = {}
    words = new_step_inputs()
    for dst, src in pairs:
        dense = dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.device == src.device
        if dense and words and dst.element_size() % 4 == 0:
            dst, src = _words(dst), _words(src)
        groups.setdefault((dst.dtype, dst.device, src.device) if dense else None, []).append((dst, src))
    for key, group in groups.items():
        if key is not None and len(group) > 1:
            torch._foreach_copy_([d for d, _ in group], [s for _, s in group], non_blocking=True)
        else:
            for dst, src in group:
                dst.copy_(src, non_blocking=True)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat int32 view (its element size a multiple of 4)."""
    return t.reshape(-1).view(torch.int32)


# a whole-graph step's block tables go row by row into the one multi-tensor copy up to this many rows (all groups
# together; torch's multi-tensor kernels take up to 64 pairs a launch), as one 2-D copy a group past it
TABLE_ROW_COPIES = 32


class StaticBatch:
    """Buffers of one batch size: padded inputs and, for CUDA graphs, the per-step metadata the captured
    kernels read (slot mappings; for whole-graph decode also block tables, sequence lengths, offsets)."""

    def __init__(self, size: int, groups, device, max_blocks: int):
        self.size = size
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.pos = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = {g: torch.full((size,), -1, dtype=torch.long, device=device) for g in groups}
        self.tables = {g: torch.zeros(size, max_blocks, dtype=torch.int32, device=device) for g in groups}
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.qsl = torch.zeros(size + 1, dtype=torch.int32, device=device)
        self.inter: dict[str, torch.Tensor] = {}  # a later pipeline stage's inputs, padded
        self.extra: dict[str, dict[str, torch.Tensor]] = {}  # forward-context extras' static buffers, by key
        self.padded: dict[str, Any] = {}  # region -> what its padding was last set for (see _pad)

    def _pad(self, name: str, key, region: torch.Tensor, value: int) -> None:
        """Sets a buffer's padding (the part past this step's rows) unless the last step that wrote the buffer
        set it for the same rows: only load and stage write these buffers, and each writes its rows and then
        this, so a padding set for the same key is still in place (a launch less for each of up to seven
        regions, in a decode batch that runs padded to its graph's size)."""
        if self.padded.get(name) != key or not new_step_inputs():
            region.fill_(value)
            self.padded[name] = key

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, copies: list | None = None) -> None:
        """The step's tokens and positions padded into this size's buffers. copies: where given, the two copies
        are appended to it (for stage to issue with its own) instead of made here."""
        n = input_ids.shape[0]
        pairs = [(self.ids[:n], input_ids), (self.pos[:n], positions)]
        if copies is None:
            copy_grouped(pairs)
        else:
            copies.extend(pairs)
        self._pad("ids", n, self.ids[n:], 0)
        self._pad("pos", n, self.pos[n:], 0)

    def load_intermediate(self, intermediate: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A later pipeline stage's inputs (hidden states, per-layer inputs) padded into this size's buffers."""
        out = {}
        for name, t in intermediate.items():
            buf = self.inter.get(name)
            if buf is None or buf.shape[1:] != t.shape[1:] or buf.dtype != t.dtype:
                buf = self.inter[name] = torch.zeros((self.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
            n = t.shape[0]
            buf[:n].copy_(t)
            buf[n:].zero_()
            out[name] = buf
        return out

    def stage(self, ctx, n: int, full: bool, copies: list | None = None):
        """A copy of the forward context whose tensors live in these buffers (padded slots are -1). The copies
        into the buffers (with `copies`, load's, passed on) go out together at the end: copy_grouped."""
        copies = [] if copies is None else copies
        meta = ctx.attn_metadata
        groups = {}
        for g, gm in meta.groups.items():
            copies.append((self.slots[g][:n], gm.slot_mapping))
            self._pad(f"slots {g}", n, self.slots[g][n:], -1)
            tables = gm.block_tables
            if full:
                rows, cols = tables.shape
                dst = self.tables[g]
                if cols < dst.shape[1] and rows * len(meta.groups) <= TABLE_ROW_COPIES and new_step_inputs():
                    copies.extend((dst[i, :cols], tables[i]) for i in range(rows))
                else:
                    copies.append((dst[:rows, :cols], tables))  # (dense where cols is the width)
                self._pad(f"tables {g}", rows, dst[rows:], 0)
                tables = dst
            groups[g] = GroupMetadata(tables, self.slots[g])
        # the token positions the K=V writers rotate their kept keys at: this size's padded buffer (load)
        meta = dataclasses.replace(meta, groups=groups, positions=self.pos)
        if full:
            s = len(meta.seq_lens)
            # from the device tensors the runner made (pinned, non-blocking); a host list copied here would
            # wait for the stream, the previous step included (async scheduling)
            lens = meta.seq_lens_tensor if meta.seq_lens_tensor is not None else torch.tensor(meta.seq_lens)
            qsl = (meta.query_start_loc_tensor if meta.query_start_loc_tensor is not None
                   else torch.tensor(meta.query_start_loc))
            copies += [(self.seq_lens[:s], lens[:s]), (self.qsl[:s + 1], qsl[:s + 1])]
            self._pad("seq_lens", s, self.seq_lens[s:], 0)
            self._pad("qsl", (s, meta.query_start_loc[-1]), self.qsl[s + 1:], meta.query_start_loc[-1])
            meta.seq_lens_tensor, meta.query_start_loc_tensor = self.seq_lens, self.qsl
            staged = dataclasses.replace(ctx, attn_metadata=meta, extra=self.stage_extras(ctx.extra, copies))
            copy_grouped(copies)
            return staged
        copy_grouped(copies)
        return dataclasses.replace(ctx, attn_metadata=meta)

    def stage_extras(self, extra: dict, copies: list | None = None) -> dict:
        """Extras a whole-graph capture reads (the recurrent state's slots and offsets) padded into static
        buffers: an extra that a captured op reads says how, with `staged(size, buffers, copies)`
        (ops/state.py)."""
        return {k: v.staged(self.size, self.extra.setdefault(k, {}), copies) if hasattr(v, "staged") else v
                for k, v in extra.items()}


class CompiledModel:
    def __init__(self, model: torch.nn.Module, config: CompilerConfig, device: torch.device,
                 whole_graph: bool = False, max_blocks_per_seq: int = 1):
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.sizes = sorted(set(config.batch_sizes))
        self.state = RunState(cudagraphs=config.cudagraphs and self.device.type == "cuda")
        # whole-graph decode needs every split op's chosen provider capturable (what they declare,
        # ops/registry.py Provider.capturable; compiler/__init__.py whole_graph_decode_ok decides)
        self.full_graph_ok = whole_graph and self.state.cudagraphs and config.full_graph_decode != "off"
        allow_many_engines()
        # on the CPU every fused op is its PyTorch reference: norms and RoPE are left to Inductor, counted
        self.pass_manager = PassManager(config.passes, config.dtype, self.device, config.tp_group,
                                        reference_only=self.device.type == "cpu",
                                        codegen_key=codegen.cache_key(self.device.type))
        self.backend = Backend(config, self.pass_manager, self.state)
        self.compiled = torch.compile(model, backend=self.backend, fullgraph=True, dynamic=False,
                                      options={"guard_filter_fn": skip_module_guards})
        self.direct = DirectForward(model, self.backend)  # its compiled code, called past Dynamo once there is some
        self.max_blocks = max_blocks_per_seq
        self.buffers: dict[int, StaticBatch] = {}
        self.full = CUDAGraphWrapper("whole forward", self.state.graph_pool)  # decode sizes that replay it
        self.decode_timings: dict[int, tuple[float, float | None]] = {}  # size -> (piecewise ms, full ms)
        self.aot = None  # compiler/aot.py AheadOfTime: the forward saved in / loaded from the compile cache

    def use_aot(self, folder, save: bool = True) -> None:
        """The forward is compiled ahead of time and saved in `folder` (when `save`), or loaded from there when
        it is saved already (a compile-cache start: no Dynamo trace)."""
        from compiled_llm.compiler.aot import AheadOfTime

        try:
            self.aot = AheadOfTime(folder, self.model, self.backend, save)
        except Exception as e:  # noqa: BLE001 - saved by another build of our code or torch: compile instead
            log.warning("the forward saved in %s cannot be loaded (%s: %s); compiling it with Dynamo", folder,
                        type(e).__name__, e)
            b = self.backend  # as before any graph was bound
            b.pieces.clear()
            b.graph_count, b.shared_hits, b.split_gm, b.attention_pieces = 0, 0, None, []
            self.aot = None

    def release_graphs(self) -> None:
        """Drops every captured CUDA graph and their memory pool. Done before the process group is left: on
        two H200s an NCCL abort waited, without end, on the communicator whose collectives sat in live graphs."""
        for piece in self.backend.pieces:
            piece.graphs.clear()
        self.full.clear()
        self.state.pool = None

    # ---- calls -------------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        for s in self.sizes:
            if s >= n:
                return s
        return None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, size: int | None,
                 intermediate: dict[str, torch.Tensor] | None = None):
        self.state.bucket = size
        first = self.backend.graph_count == 0
        if first:  # the phases of a start-up (issue 15): Dynamo's trace, our backend, then the first run
            self.backend.call_started = time.perf_counter()
        try:
            return self._run_compiled(input_ids, positions, intermediate)
        finally:
            if first and self.backend.graph_count:
                log.info("first forward: Dynamo's trace %.1fs (%d nodes), pieces %.1fs, run %.1fs",
                         *self.backend.phases(time.perf_counter()))

    def _run_compiled(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        args = (input_ids, positions) if intermediate is None else (input_ids, positions, intermediate)
        for t in (input_ids, positions, *(intermediate or {}).values()):  # the token dimension is dynamic
            torch._dynamo.mark_dynamic(t, 0)
        if self.aot is None:  # Dynamo's code for this call, run without Dynamo's frame evaluation
            out = self.direct(args)
            if out is not MISS:
                return out
        with fx_config.patch(**_NO_01_SPECIALISATION):  # one compile serves a single token too
            if self.aot is not None:
                out = self._run_aot(args)
                if out is not None:
                    return out
            return self.compiled(*args)

    def _run_aot(self, args: tuple):
        """The ahead-of-time forward's output, or None (with a warning) when it cannot be compiled that way:
        this model then compiles as without a compile cache (Dynamo traces it at every start)."""
        from compiled_llm.compiler.aot import CannotCompile

        try:
            return self.aot(*args)
        except CannotCompile as e:  # (an error while running a compiled forward is raised as it is)
            log.debug("the ahead-of-time compile failed", exc_info=True)
            log.warning("the forward cannot be compiled ahead of time (%s); compiling it with Dynamo at each start "
                        "instead", e)
        self.aot = None
        return None

    def static_batch(self, size: int) -> StaticBatch:
        if size not in self.buffers:
            groups = get_forward_context().attn_metadata.groups.keys()
            self.buffers[size] = StaticBatch(size, groups, self.device, self.max_blocks)
        return self.buffers[size]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 intermediate: dict[str, torch.Tensor] | None = None):
        """Hidden states; under pipeline parallelism a later stage takes the previous stage's tensors in
        `intermediate` and a stage before the last returns its own (a dict)."""
        with MONITOR.watch(self.config.jit_monitor):
            return self._call(input_ids, positions, intermediate)

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        n = input_ids.shape[0]
        size = self.bucket_for(n)
        if size is None:
            return self._forward(input_ids, positions, None, intermediate)
        buf = self.static_batch(size)
        pending: list = []  # load's copies, issued with stage's (one launch per dtype)
        buf.load(input_ids, positions, pending)
        inter = buf.load_intermediate(intermediate) if intermediate is not None else None
        if not self.state.cudagraphs:
            copy_grouped(pending)
            return _first(self._forward(buf.ids, buf.pos, size, inter), n)
        ctx = get_forward_context()
        whole = BatchDescriptor(size, whole=True)
        # a decode batch, and no forward-context extra that needs this step run piecewise (sparse KV: a
        # one-token row that is the last token of a prompt, which OmniKV attends densely)
        full = (whole in self.full and len(ctx.attn_metadata.seq_lens) == n
                and all(getattr(v, "whole_graph_ok", True) for v in ctx.extra.values()))
        with set_forward_context(buf.stage(ctx, n, full, pending)):
            out = self.full.replay(whole) if full else self._forward(buf.ids, buf.pos, size, inter)
        return _first(out, n)

    # ---- whole-graph decode ------------------------------------------------------------------
    def choose_decode_graph(self, size: int, repeats: int = 20) -> None:
        """Captures the whole forward for a decode batch of `size` (under the warm-up's decode context),
        times it against the piecewise replay, and keeps it only if faster."""
        if not self.full_graph_ok:
            return
        buf = self.static_batch(size)
        ctx = get_forward_context()
        n = len(ctx.attn_metadata.seq_lens)

        staged_pieces, staged_full = buf.stage(ctx, n, False), buf.stage(ctx, n, True)  # copies stay outside captures

        def piecewise():
            with set_forward_context(staged_pieces):
                return self._forward(buf.ids, buf.pos, size)

        def whole():  # (the pieces run inline while the whole forward is being captured: cuda_graph.py)
            with set_forward_context(staged_full):
                return self._forward(buf.ids, buf.pos, size)

        piecewise()  # captures the per-piece graphs if not yet
        desc = BatchDescriptor(size, whole=True)
        entry = self.full.capture(desc, whole)
        t_piece = _time(piecewise, repeats)
        with set_forward_context(staged_full):
            t_full = _time(entry.replay, repeats)
        self.decode_timings[size] = (t_piece, t_full)
        if not (self.config.full_graph_decode == "on" or t_full < t_piece):
            self.full.drop(desc)
        log.info("decode batch %d: piecewise CUDA graphs %.3f ms, whole-graph %.3f ms -> %s", size, t_piece, t_full,
                 "whole graph" if desc in self.full else "piecewise")

    # ---- report ------------------------------------------------------------------------------
    def matches_by_shape(self) -> dict[str, Counter]:
        """Per compile ('dynamic', or a static batch size): the passes' matches summed over the pieces, with
        their per-layer keys ('geglu_moe@3')."""
        out: dict[str, Counter] = {}
        for piece in self.backend.pieces:
            for shape, counter in piece.matches.items():
                out.setdefault(shape, Counter()).update(counter)
        return out

    def summary(self) -> dict:
        matches = self.matches_by_shape().get("dynamic", Counter())
        graphs = sum(len(p.graphs) for p in self.backend.pieces) + len(self.full)
        return {
            "passes": {name: {"fusion": fusion, "matches": matches.get(name, 0)}
                       for name, fusion in self.pass_manager.fusions().items()},
            "pieces": sum(1 for p in self.backend.pieces if p.graph == 0),  # of the first Dynamo graph
            "dynamo_graphs": self.backend.graph_count,
            # Inductor compiles a look-alike piece reused instead of compiling its own (every shape counted)
            "shared_compiles": self.backend.shared_hits,
            "attention_ops": len(self.backend.attention_pieces),
            "static_sizes": self.sizes,
            "captured_graphs": graphs,
            "whole_graph_decode_sizes": sorted(d.tokens for d in self.full),
            "whole_graph_replays": sum(self.full.replays.values()),  # decode steps that ran the whole graph
            "decode_timings_ms": {str(k): v for k, v in self.decode_timings.items()},
            "ahead_of_time": None if self.aot is None else self.aot.status(),
        }


def _first(out, n: int):
    """The first n rows of the output (a tensor, or a pipeline stage's dict of tensors)."""
    return {k: v[:n] for k, v in out.items()} if isinstance(out, dict) else out[:n]


def _time(fn, repeats: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / repeats
