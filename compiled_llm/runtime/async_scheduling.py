"""Async scheduling: the next step is scheduled and launched while the last one runs on the device. When an
engine can run that way, which requests make it step synchronously, and what a launched step carries until its
sampled tokens are read (the engine's `_step_async` drives it).

The sampled tokens stay on the device and feed the next step's inputs there (sampler.py `fill_pending`).
Under tensor parallelism every rank needs them in its own inputs: rank 0 alone samples (the draws are the
one-process engine's, seeded or greedy) and broadcasts the few it needs over the tensor-parallel group on the
device, at the start of the next step (executor/worker.py `_fill_pending`); the step itself goes to the workers
prepared on the host, naming the rows the tokens go to. Sampling on every rank instead would need every
rank's RNG state kept equal and bit-identical logits on all of them. Pipeline-parallel engines still step
synchronously (not built yet: its stages already run one after another within a step, without micro-batches)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from compiled_llm.config import EngineConfig
from compiled_llm.runtime.sampler import PendingTokens, SampledBatch
from compiled_llm.runtime.sequence import Sequence
from compiled_llm.sampling_params import SamplingParams

log = logging.getLogger("compiled_llm")
PLACEHOLDER = -1  # a token sampled on the device and not yet read (async scheduling)


def needs_host_history(params: SamplingParams) -> bool:
    """Penalties read every earlier output token on the host when sampling, and a grammar (structured output)
    must have accepted the last token before it can mask the next; under async scheduling the last one is still
    on its way there, so such a request runs the engine synchronously while it lasts. So does one that asks for
    its prompt's logprobs (read from the step's logits on the host: runtime/prompt_logprobs.py), and one with
    bad_words (the sampler matches the output's last tokens against them)."""
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0 or params.structured_output is not None
            or params.prompt_logprobs is not None or bool(params.bad_words))


@dataclass
class InFlight:
    """A step launched under async scheduling whose sampled tokens have not been read yet."""

    done: list[Sequence]  # the sequences that sample a token, in the sampled rows' order
    sampled: SampledBatch
    pending: PendingTokens  # for the next step's inputs: the rows of sequences that continue


def async_scheduling_possible(config: EngineConfig, executor) -> bool:
    """Asked for (True): on, or a warning saying why not. Default (None): on where it can overlap the host
    with the device (CUDA, one process or tensor parallel; sparse KV methods in one process), silently off
    elsewhere."""
    if config.async_scheduling is False:
        return False
    why = None
    if not executor.supports_async_scheduling:
        why = executor.async_refusal
    elif executor.sparse is not None and getattr(config, "tensor_parallel_size", 1) > 1:
        # (one process: tokens equal the synchronous engine's, tests/test_async_scheduling.py; under tensor
        # parallelism not checked yet)
        why = "sparse KV methods under tensor parallelism step synchronously"
    elif config.async_scheduling is None and not str(config.device).startswith("cuda"):
        return False  # the CPU runs each step as it is launched: nothing to overlap
    if why:
        if config.async_scheduling:
            log.warning("async scheduling is off: %s", why)
        return False
    return True
