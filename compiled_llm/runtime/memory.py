"""The GPU memory plan, as vLLM makes it: the engine may use `gpu_memory_utilization` x the GPU's total
memory. What is in use once the weights are loaded, the activation peak of one full
`max_num_batched_tokens` step (measured by a dummy forward before the KV cache exists) and a fixed margin
come out of that; the KV cache gets the rest. Taking a fraction of *free* memory before any forward ran
(what the runner did before) left no room for the activations, so the first long prefill ran out of
memory.

Only arithmetic lives here, so it is tested on the CPU with made-up numbers; `ModelRunner.measure_memory`
measures the inputs on the GPU.
"""

from __future__ import annotations

from compiled_llm.runtime.block_pool import Group, group_sinks, group_window

GIB = 1 << 30
# CUDA-graph memory pools (captured after the KV cache exists), the sampler's float32 work on the logits
# (softmax, top-p sort) and allocator fragmentation: none of them is in the profiled forward.
GPU_MARGIN_BYTES = 1 << 30


def gib(num_bytes: int) -> str:
    """GiB with two decimals; below 0.01 GiB in MiB (a tiny model's KV need must not read as 0.00 GiB)."""
    if abs(num_bytes) < GIB // 100:
        return f"{num_bytes / (1 << 20):.2f} MiB"
    return f"{num_bytes / GIB:.2f} GiB"


def sequence_blocks(group: Group, max_model_len: int, block_size: int) -> int:
    """Blocks one max_model_len sequence needs in a group: all its tokens in the full group; in a sliding
    group its window, a block of slack and the sink blocks. Plus the block the next token goes into, the
    rule the engine's capacity check applies (`n * block_size >= need + block_size`)."""
    window = group_window(group)
    need = max_model_len
    if window is not None:
        need = min(max_model_len, window + block_size + -(-group_sinks(group) // block_size) * block_size)
    return -(-need // block_size) + 1


def one_sequence_bytes(block_bytes: dict[Group, int], max_model_len: int, block_size: int) -> int:
    """Bytes of KV cache one max_model_len sequence needs across all groups (block_bytes: one block of each
    group, all its layers together)."""
    return sum(sequence_blocks(g, max_model_len, block_size) * b for g, b in block_bytes.items())


def prompt_graph_bytes(activation_peak_bytes: int, graph_sizes, max_num_seqs: int, max_tokens: int) -> int:
    """What the CUDA-graph pool keeps for the prompt sizes (those above max_num_seqs): one forward's
    activations at the largest, estimated as the profiled step's peak scaled to its tokens. (On the H200 the
    1,024-token graphs of 26B-A4B raised the peak by 1.3 GiB, more than the margin holds on its own; decode
    sizes keep a few tokens' worth, which the margin covers.)"""
    prompt = [s for s in graph_sizes if s > max_num_seqs]
    if not prompt or max_tokens <= 0:
        return 0
    return activation_peak_bytes * min(max(prompt), max_tokens) // max_tokens


def kv_cache_budget(total_bytes: int, utilization: float, in_use_bytes: int, activation_peak_bytes: int,
                    need_bytes: int, max_model_len: int, margin_bytes: int = GPU_MARGIN_BYTES) -> int:
    """Bytes the KV cache (and recurrent state) may take: utilization x total, less what is in use before
    the cache is allocated (weights, CUDA context, other processes), the activation peak of a full step and
    the margin. Raises a one-line ValueError, naming the flags to change, when that is less than need_bytes
    (one max_model_len sequence): better to refuse at start-up than to fail on the first long request."""
    allowed = int(total_bytes * utilization)
    budget = allowed - in_use_bytes - activation_peak_bytes - margin_bytes
    if budget < need_bytes:
        raise ValueError(
            f"the KV cache needs {gib(need_bytes)} for one {max_model_len}-token sequence, but only "
            f"{gib(max(budget, 0))} is left: {utilization:g} x {gib(total_bytes)} total = {gib(allowed)}, less "
            f"{gib(in_use_bytes)} in use after loading the weights, {gib(activation_peak_bytes)} activation peak "
            f"and {gib(margin_bytes)} margin; raise --gpu-memory-utilization, or lower --max-model-len or "
            "--max-num-batched-tokens")
    return budget
