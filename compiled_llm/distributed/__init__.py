"""Tensor, pipeline and expert parallelism: process groups, the parallel state and collectives."""

from compiled_llm.distributed.communication import tp_all_gather, tp_all_reduce, tp_all_to_all
from compiled_llm.distributed.parallel_state import (ParallelState, get_parallel_state, partition_layers,
                                                     set_parallel_state)

__all__ = ["ParallelState", "get_parallel_state", "set_parallel_state", "partition_layers", "tp_all_reduce",
           "tp_all_gather", "tp_all_to_all"]
