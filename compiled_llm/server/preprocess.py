"""Prompt preprocessing off the event loop: chat templates, tokenization and media placeholder expansion run
in a small thread pool, so one huge prompt never stalls /health, other requests' admission or the streams.

Each worker thread uses an input processor of its own (`LLMEngine.new_input_processor()`, made before the
engine thread starts): a Rust tokenizer is never used by two threads at once. A processor is taken from a
free list for the call and given back after it, so any worker may run any call. The event loop keeps its
own processor for what is cheap and per token (logprob token texts)."""

from __future__ import annotations

import asyncio
import queue
from concurrent.futures import ThreadPoolExecutor

PREPROCESS_THREADS = 2


class Preprocessor:
    def __init__(self, processors: list):
        self._free: queue.Queue = queue.Queue()
        for p in processors:
            self._free.put(p)
        self._pool = ThreadPoolExecutor(max_workers=len(processors), thread_name_prefix="preprocess")

    def _call(self, fn, args):
        inputs = self._free.get()
        try:
            return fn(inputs, *args)
        finally:
            self._free.put(inputs)

    async def run(self, fn, *args):
        """fn(input_processor, *args) in a worker thread; its exceptions (APIError for bad input) propagate."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, fn, args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
