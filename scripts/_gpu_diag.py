import os, sys, tempfile, re
sys.path[:0] = ["scripts", "tests"]
import logging
from pathlib import Path
import torch
from gpu_smoke import make_tiny
from compiled_llm import LLM
root = Path(tempfile.mkdtemp())
name = sys.argv[1]
f = make_tiny(root, name)
llm = LLM(str(f), device="cuda", dtype="float32", enforce_eager=False, cudagraph_batch_sizes=sys.argv[2],
          full_graph_decode="off", fusion_check="warn", block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
print("SHAPES", {k: dict(v) for k, v in llm.engine.runner.compiler.compiled.matches_by_shape().items()})
