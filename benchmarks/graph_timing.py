"""Per-call GPU time of a small function the way a decode step runs it: `calls` calls captured in one CUDA
graph (after a few warm-up calls on a side stream), replayed `replays` times between CUDA events."""

from __future__ import annotations

from typing import Callable

import torch


def graph_time_us(fn: Callable, replays: int = 50, calls: int = 10, before: Callable | None = None) -> float:
    """Microseconds per call; `before` runs just before the timed replays (e.g. a barrier across ranks)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    if before is not None:
        before()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def kernel_timer(smoke: bool, calls: int = 10, replays: int = 20) -> Callable:
    """fn -> microseconds a call: graph_time_us on the GPU; under the Triton interpreter (smoke runs on the CPU)
    one call's wall time, which only shows the path runs (the ordering of candidates means nothing there)."""
    if smoke:
        import time

        def run(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        return run
    return lambda fn: graph_time_us(fn, replays=replays, calls=calls)


def start_profiler() -> torch.profiler.profile:
    """A torch.profiler session, entered: CPU events, and the device's kernels where there is a GPU (the caller
    exits it after the steps it wants)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    acts += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    prof = torch.profiler.profile(activities=acts)
    prof.__enter__()
    return prof
