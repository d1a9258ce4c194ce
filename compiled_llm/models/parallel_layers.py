"""Layers split across the ranks of a tensor-parallel group, each loading its slice of the checkpoint.

Every split parameter carries `weight_loader(param, full_tensor) -> elements written` (the loader calls
it with the checkpoint's whole tensor) and `full_shape` (the checkpoint shape, for the loader's shape
check). At tensor-parallel size 1 each layer is exactly the plain PyTorch layer it replaces:
`ColumnParallelLinear`/`RowParallelLinear`/`HeadParallelLinear` compute `F.linear(x, weight)`,
`VocabParallelEmbedding` computes `F.embedding(ids, weight)`, with the checkpoint's parameter names.

- column parallel: the output features are split; the output stays split (it feeds a row-parallel layer).
- head parallel (q/k/v projections): split by whole heads; with fewer heads than ranks (Gemma 4's global
  layers have 1 or 2 KV heads) each rank holds the one head its query heads read, so KV heads are
  replicated tp / num_heads times.
- merged column parallel: an output that concatenates segments ([q; k; v; z; b; a] of a linear-attention
  layer); each segment is split evenly (or by `ranges`), a rank holds its slice of each
  (`segment_parameter` does the same for the conv weights and per-head vectors that must follow the split).
- row parallel: the input features are split; the partial products are summed with an all-reduce.
- vocabulary parallel: each rank holds a contiguous block of ceil(vocab / tp) rows (zero padded);
  embedding lookups are summed over the group, logits gathered.
- experts: tensor parallel splits every expert's intermediate dimension; expert parallel gives each rank
  whole experts. `ExpertWeights` owns the packed [gate, up] layout and how it is split and loaded.
"""

from __future__ import annotations

import inspect
import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from compiled_llm.distributed.communication import tp_all_gather, tp_all_reduce, tp_all_to_all
from compiled_llm.distributed.parallel_state import get_parallel_state
from compiled_llm.ops.linear import linear_rows


def divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({parts})")
    return n // parts


def _parameter(shape: tuple[int, ...], full_shape: tuple[int, ...], loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape))
    p.full_shape = tuple(full_shape)
    p.weight_loader = _weakly(loader)
    return p


def _weakly(loader):
    """A layer's own method, held without holding the layer. A parameter that held it strongly closed a cycle
    (parameter -> method -> layer -> parameter), and the engine freezes the heap after start-up (gc.freeze,
    runtime/heap.py), so the collector never freed it: a deleted engine kept those weights, its embedding, every
    row-parallel projection and the experts. Without the cycle, reference counting frees them."""
    if not inspect.ismethod(loader):
        return loader
    method = weakref.WeakMethod(loader)
    return lambda *args, **kwargs: method()(*args, **kwargs)


def _copy(param: torch.Tensor, value: torch.Tensor) -> int:
    with torch.no_grad():
        param.copy_(value.to(param.dtype))
    return value.numel()


def local_num_heads(num_heads: int) -> int:
    """Heads one rank holds: an even share, or one (replicated) when there are fewer heads than ranks."""
    tp = get_parallel_state().tp_size
    return divide(num_heads, tp, "attention heads") if num_heads >= tp else 1


class PPMissingLayer(nn.Module):
    """Stands for a module another pipeline stage owns: holds nothing, must not be called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer belongs to another pipeline stage")


def make_layers(num_layers: int, start: int, end: int, build) -> nn.ModuleList:
    """build(i) for the layers [start, end) this stage owns, placeholders elsewhere: indices stay global."""
    return nn.ModuleList([build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)])


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (output features) split across ranks: each rank outputs its slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False):
        super().__init__()
        ps = get_parallel_state()
        self.tp_size, self.tp_rank = ps.tp_size, ps.tp_rank
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.rows = self._local_rows(out_features)
        n = self.rows.stop - self.rows.start
        self.weight = _parameter((n, in_features), (out_features, in_features), self._load)
        self.bias = _parameter((n,), (out_features,), self._load) if bias else None

    def _local_rows(self, out_features: int) -> range:
        n = divide(out_features, self.tp_size, "output features")
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def _load(self, param: nn.Parameter, full: torch.Tensor) -> int:
        return _copy(param, full[self.rows.start:self.rows.stop])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return tp_all_gather(y, -1) if self.gather_output else y


class HeadParallelLinear(ColumnParallelLinear):
    """A q, k or v projection split by whole heads. With fewer heads than ranks, rank r holds head
    r * num_heads // tp: the one its query heads attend with (query heads split evenly)."""

    def __init__(self, in_features: int, num_heads: int, head_dim: int, bias: bool = False):
        self.num_heads, self.head_dim = num_heads, head_dim
        super().__init__(in_features, num_heads * head_dim, bias)

    def _local_rows(self, out_features: int) -> range:
        self.num_local_heads = local_num_heads(self.num_heads)
        return head_rows(self.num_heads, self.head_dim)


def head_rows(num_heads: int, head_dim: int) -> range:
    """The rows of a [num_heads * head_dim, in] projection this rank holds: an even share of whole heads, or,
    with fewer heads than ranks, head r * num_heads // tp (the one its query heads attend with)."""
    ps = get_parallel_state()
    tp, r = ps.tp_size, ps.tp_rank
    n = local_num_heads(num_heads)
    if num_heads >= tp:
        first = r * n
    elif tp % num_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of the {num_heads} KV "
                         "head(s) when it exceeds them")
    else:
        first = r * num_heads // tp
    return range(first * head_dim, (first + n) * head_dim)


def rank_segments(sizes: list[int], what: str) -> list[tuple[int, int]]:
    """(offset, length) of this rank's slice of each segment of a dimension that concatenates segments of
    `sizes` (e.g. [q; k; v]), every segment split evenly across the ranks."""
    ps = get_parallel_state()
    out, offset = [], 0
    for size in sizes:
        n = divide(size, ps.tp_size, what)
        out.append((offset + ps.tp_rank * n, n))
        offset += size
    return out


def segment_parameter(full_shape: tuple[int, ...], sizes: list[int], what: str,
                      ranges: list[range] | None = None) -> nn.Parameter:
    """A parameter whose first dimension concatenates segments of `sizes`; this rank holds `ranges[i]` of
    segment i (rows relative to the segment; default: an even split of every segment), in the same order.
    One call per tensor that must agree on which rows a rank holds: a merged projection's weight, and the
    per-channel conv weights or per-head vectors that read its output. It loads from the checkpoint's merged
    tensor, or from a tensor that holds one segment or a run of consecutive ones (index: their rows of the
    merged shape, as `MergedColumnParallelLinear.segment` names them) for checkpoints that keep them apart."""
    if ranges is None:
        ranges = [range(a - o, a - o + n) for (a, n), o in zip(rank_segments(sizes, what), _offsets(sizes))]
    offsets = _offsets(sizes)
    local = (sum(len(r) for r in ranges), *full_shape[1:])

    def load(param: nn.Parameter, full: torch.Tensor, index: slice | None = None) -> int:
        if index is None:
            return _copy(param, torch.cat([full[o + r.start:o + r.stop] for o, r in zip(offsets, ranges)]))
        written = 0
        for i in range(offsets.index(index.start), len(sizes)):
            if offsets[i] >= index.stop:
                break
            at, rows = sum(len(r) for r in ranges[:i]), full[offsets[i] - index.start:]  # `full` starts at index
            written += _copy(param[at:at + len(ranges[i])], rows[ranges[i].start:ranges[i].stop])
        return written

    return _parameter(local, full_shape, load)


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections of one input in one matrix, which one GEMM computes: [q; k; v] of
    an attention layer, [gate; up] of an MLP, [q; k; v; z; b; a] of a linear-attention layer (whose checkpoint
    holds [q; k; v] in one tensor and z, b, a in three). At decode sizes one wide GEMM reads the weights faster
    than several narrow ones, and launches once (a small GEMM costs its launch latency however small).
    Each segment is split evenly, or by `ranges` (whole heads, or all rows of a segment every rank holds);
    a rank's output is its slices in order ([q_r; k_r; v_r]) and `local_sizes` separates them."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False, ranges: list[range] | None = None):
        super().__init__()
        self.in_features, self.sizes = in_features, list(sizes)
        out = sum(sizes)
        self.weight = segment_parameter((out, in_features), sizes, "output features", ranges)
        self.bias = segment_parameter((out,), sizes, "output features", ranges) if bias else None
        self.local_sizes = [len(r) for r in ranges] if ranges is not None else \
            [n for _, n in rank_segments(sizes, "output features")]

    def segment(self, i: int, count: int = 1) -> slice:
        """The rows of segments i, ..., i + count - 1 of the merged (checkpoint-shaped) weight: the loader's
        index for a checkpoint tensor that holds those segments."""
        start = sum(self.sizes[:i])
        return slice(start, start + sum(self.sizes[i:i + count]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def head_parallel_segments(in_features: int, num_heads: list[int], head_dim: int) -> MergedColumnParallelLinear:
    """[q; k; v] in one projection, every segment split by whole heads as `HeadParallelLinear` splits it."""
    return MergedColumnParallelLinear(in_features, [n * head_dim for n in num_heads],
                                      ranges=[head_rows(n, head_dim) for n in num_heads])


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split: x arrives split, partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True):
        super().__init__()
        ps = get_parallel_state()
        self.tp_size, self.tp_rank = ps.tp_size, ps.tp_rank
        self.in_features, self.out_features = in_features, out_features
        self.reduce = reduce
        n = divide(in_features, self.tp_size, "input features")
        self.cols = range(self.tp_rank * n, (self.tp_rank + 1) * n)
        self.weight = _parameter((out_features, n), (out_features, in_features), self._load)
        # the bias is added once, after the sum
        self.bias = _parameter((out_features,), (out_features,), _copy) if bias else None

    def _load(self, param: nn.Parameter, full: torch.Tensor) -> int:
        return _copy(param, full[:, self.cols.start:self.cols.stop])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce:
            y = tp_all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows: rank r holds tokens [r * ceil(V / tp), ...) (zero padded). Also
    the LM head: `logits(hidden)` multiplies by the table and gathers the vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        ps = get_parallel_state()
        self.tp_size = ps.tp_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = -(-num_embeddings // ps.tp_size)
        self.start = ps.tp_rank * per
        self.num_real = max(0, min(per, num_embeddings - self.start))  # rows that are not padding
        self.weight = _parameter((per, embedding_dim), (num_embeddings, embedding_dim), self._load)

    def _load(self, param: nn.Parameter, full: torch.Tensor) -> int:
        with torch.no_grad():
            param.zero_()
        _copy(param[:self.num_real], full[self.start:self.start + self.num_real])
        return param.numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, dim] -> [n, num_embeddings], complete on every rank of the group. A decode batch's rows go
        through skinny_mm where that op takes the shape on this GPU (ops/linear.py: the LM heads on an H200)."""
        out = linear_rows(hidden, self.weight)
        if self.tp_size == 1:
            return out
        return tp_all_gather(out, -1)[:, :self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary like the embedding it may be tied to."""


# ---- routed experts --------------------------------------------------------------------------------
# With expert parallelism, tokens are replicated over the group (attention is tensor parallel), so
# "all-gather" is free and the combine is one all-reduce (= reduce-scatter + all-gather). All-to-all
# dispatch sends each (token, expert) pair to its expert's rank and back: 2 * top_k / tp of the
# activations each way, plus an all-gather, against about 2x for the all-reduce, and four collectives
# instead of one. It wins only for large batches with top_k < tp / 2; COMPILED_LLM_MOE_DISPATCH
# (auto | all_reduce | all_to_all) forces a choice.
A2A_MIN_TOKENS = 512


class ExpertWeights(nn.Module):
    """Routed experts' packed weights, gate_up_proj [E, 2I, H] ([gate; up] per expert) and down_proj
    [E, H, I] in the checkpoint. Tensor parallel: every expert, rows [r*I/tp, (r+1)*I/tp) of its gate and
    of its up projection (packed [gate_r; up_r]) and those columns of down_proj. Expert parallel: experts
    [r*E/tp, (r+1)*E/tp), whole. Subclasses compute with `gate_up_proj[local]`, `down_proj[local]` for
    the experts `local_expert(e)` maps, and combine with `combine` (or use `dispatch_all_to_all`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int):
        super().__init__()
        ps = get_parallel_state()
        self.tp_size = ps.tp_size
        self.expert_parallel = ps.enable_expert_parallel and ps.tp_size > 1
        self.num_experts, self.top_k = num_experts, top_k
        self.intermediate = intermediate
        if self.expert_parallel:
            self.num_local_experts = divide(num_experts, ps.tp_size, "routed experts")
            self.first_expert = ps.tp_rank * self.num_local_experts
            self.local_intermediate, self.first_row = intermediate, 0
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.local_intermediate = divide(intermediate, ps.tp_size, "expert intermediate size")
            self.first_row = ps.tp_rank * self.local_intermediate
        e, i = self.num_local_experts, self.local_intermediate
        self.gate_up_proj = _parameter((e, 2 * i, hidden), (num_experts, 2 * intermediate, hidden), self._load_gate_up)
        self.down_proj = _parameter((e, hidden, i), (num_experts, hidden, intermediate), self._load_down)
        mode = os.environ.get("COMPILED_LLM_MOE_DISPATCH", "auto").replace("allreduce", "all_reduce")
        if mode not in ("auto", "all_reduce", "all_to_all"):
            raise ValueError(f"COMPILED_LLM_MOE_DISPATCH must be auto, all_reduce or all_to_all, not {mode!r}")
        self.dispatch = mode

    # loading: `full` is the checkpoint's tensor of all experts, or of one (index (e,)), or one expert's gate
    # or up projection alone (index (e, rows [0, I) or [I, 2I)): checkpoints that keep experts unpacked)
    def _load_experts(self, param: nn.Parameter, full: torch.Tensor, index: tuple | None, take) -> int:
        if index is None:
            return _copy(param, take(full[self.first_expert:self.first_expert + self.num_local_experts]))
        local = self.local_expert(index[0])
        if local is None:
            return 0  # another rank's expert
        return _copy(param[local], take(full.unsqueeze(0))[0])

    def _load_gate_up(self, param: nn.Parameter, full: torch.Tensor, index: tuple | None = None) -> int:
        i, a, n = self.intermediate, self.first_row, self.local_intermediate
        if index is not None and len(index) == 2:  # one expert's gate (rows [0, I)) or up (rows [I, 2I))
            local, half = self.local_expert(index[0]), index[1].start // i
            return 0 if local is None else _copy(param[local, half * n:(half + 1) * n], full[a:a + n])
        return self._load_experts(param, full, index,
                                  lambda w: torch.cat([w[:, a:a + n], w[:, i + a:i + a + n]], dim=1))

    def _load_down(self, param: nn.Parameter, full: torch.Tensor, index: tuple | None = None) -> int:
        a, n = self.first_row, self.local_intermediate
        return self._load_experts(param, full, index, lambda w: w[:, :, a:a + n])

    def local_expert(self, e: int) -> int | None:
        local = e - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Sums the ranks' partial outputs (their slices of the intermediate dim, or their experts)."""
        return tp_all_reduce(partial)

    def use_all_to_all(self, num_tokens: int) -> bool:
        if not self.expert_parallel or self.dispatch == "all_reduce":
            return False
        if self.dispatch == "all_to_all":
            return True
        return num_tokens >= A2A_MIN_TOKENS and 2 * self.top_k < self.tp_size

    def dispatch_all_to_all(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, compute) -> torch.Tensor:
        """Expert parallel with all-to-all: rank r routes tokens [r*ceil(n/tp), ...) of the (replicated)
        batch, sends each (token, expert) row to the expert's rank, which returns compute(rows, weight,
        expert) for it; the routed shards are summed per token and all-gathered."""
        ps = get_parallel_state()
        tp, n, k = self.tp_size, x.shape[0], ids.shape[1]
        per = -(-n // tp)
        lo, hi = min(ps.tp_rank * per, n), min((ps.tp_rank + 1) * per, n)
        token = torch.arange(hi - lo, device=x.device).repeat_interleave(k)
        expert, weight = ids[lo:hi].reshape(-1), weights[lo:hi].reshape(-1)
        dest = expert // self.num_local_experts
        order = torch.argsort(dest, stable=True)
        token, expert, weight, dest = token[order], expert[order], weight[order], dest[order]
        send = torch.bincount(dest, minlength=tp)
        recv = tp_all_to_all(send, [1] * tp, [1] * tp)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        rows = tp_all_to_all(x[lo:hi][token], send_counts, recv_counts)
        r_expert = tp_all_to_all(expert, send_counts, recv_counts)
        r_weight = tp_all_to_all(weight, send_counts, recv_counts)
        y = compute(rows, r_weight[:, None], r_expert[:, None])
        back = tp_all_to_all(y, recv_counts, send_counts)
        shard = torch.zeros(per, x.shape[1], dtype=x.dtype, device=x.device)
        shard.index_add_(0, token, back.to(x.dtype))
        return tp_all_gather(shard, 0)[:n]
