import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# One intra-op thread in the test process: the tiny models gain nothing from a second one (the same time on an
# idle machine), and with two every parallel region (index_add_ in the MoE reference, ...) waits for the OpenMP
# thread whenever the other core is busy: a TP worker process, a server, Inductor's g++, another job (tiny eager
# steps stalled 40-60 ms per op). test_parallel*.py, whose worker process shares the two cores: 90 s -> 52 s on an
# otherwise idle machine; test_gemma4_equivalence.py beside another job: 173 s -> 47 s.
# Spawned workers, servers and CLI runs choose their own (worker_main.py; torch's default).
torch.set_num_threads(1)
# The engine freezes Python's heap after start-up (runtime/engine.py freeze_startup_heap): right for a process
# that serves one engine, but the suite builds hundreds, and garbage frozen with each would never be collected.
os.environ.setdefault("COMPILED_LLM_GC_FREEZE", "0")
# A CPU engine compiles its forward as one graph by default (--split-graph auto); the suite's engines split it at
# the attention ops as a GPU engine does, so that they run the pieces the GPU runs (and compile look-alike layers
# once). test_compiler.py's one-graph tests unset this.
os.environ.setdefault("COMPILED_LLM_SPLIT_GRAPH", "on")

from qwen3_5_tiny import make_qwen_checkpoint  # noqa: E402
from tiny_models import make_checkpoint  # noqa: E402

_CACHE: dict[str, tuple[Path, object]] = {}
_QWEN: dict[str, tuple[Path, object]] = {}


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(name) -> (folder, transformers model) built once per session."""

    def get(name: str):
        if name not in _CACHE:
            folder = tmp_path_factory.mktemp(f"gemma4_{name}")
            model = make_checkpoint(folder, name)
            _CACHE[name] = (folder, model)
        return _CACHE[name]

    return get


@pytest.fixture(scope="session")
def qwen_ckpt(tmp_path_factory):
    """qwen_ckpt(name) -> (folder, transformers model) of a tiny Qwen3.5 checkpoint, built once per session."""

    def get(name: str):
        if name not in _QWEN:
            folder = tmp_path_factory.mktemp(f"qwen3_5_{name}")
            _QWEN[name] = (folder, make_qwen_checkpoint(folder, name))
        return _QWEN[name]

    return get
