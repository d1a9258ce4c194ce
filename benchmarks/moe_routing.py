"""How many distinct experts a decode step's batch touches in each MoE layer of the engine's own run, against
the count the floor takes (benchmarks/floor.py `expected_touched`: each token's k picks uniform and
independent).

The decode MoE kernels stream the touched experts' weights, so their time follows this count: where a run's
batches touch more experts than the expectation, its MoE reads more bytes than the floor counts, and fewer where
the tokens agree on experts. The engine runs eager here (the models then call the PyTorch routers, which this
script wraps to count the picks), on the prompts benchmarks/throughput.py gives the same shape, with the
preset's dummy weights unless --model names a checkpoint.

    python3 benchmarks/moe_routing.py [--config qwen3.5-35b-a3b] [--shape 1024x8x16] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from configs import PRESETS, write_checkpoint_folder  # noqa: E402
from floor import expected_touched  # noqa: E402
from throughput import random_prompts  # noqa: E402

from compiled_llm import LLM, SamplingParams  # noqa: E402
from compiled_llm.models import gemma4, qwen3_5  # noqa: E402

ROUTERS = ((gemma4, "ref_router_topk"), (qwen3_5, "ref_softmax_router_topk"))  # what each model's forward calls


class RouteCounter:
    """Wraps the models' routers while active: the distinct experts of every call with `batch` rows (a decode
    step's), in call order (layer order within a step)."""

    def __init__(self, batch: int):
        self.batch, self.counts, self._saved = batch, [], []

    def __enter__(self):
        for module, name in ROUTERS:
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
            setattr(module, name, self._wrap(fn))
        return self

    def __exit__(self, *exc):
        for module, name, fn in self._saved:
            setattr(module, name, fn)
        self._saved.clear()

    def _wrap(self, fn):
        def routed(x, *args, **kwargs):
            weights, ids = fn(x, *args, **kwargs)
            if ids.shape[0] == self.batch:
                self.counts.append(int(torch.unique(ids).numel()))
            return weights, ids
        return routed


def moe_shape(cfg: dict) -> tuple[int, int, int]:
    """(experts, picks a token, MoE layers) of a flat text config."""
    experts = cfg.get("num_experts") or 0
    top_k = cfg.get("top_k_experts") or cfg.get("num_experts_per_tok") or 0
    if not experts or (cfg.get("model_type", "").startswith("gemma") and not cfg.get("enable_moe_block")):
        raise SystemExit("moe_routing: the config has no MoE layers")
    return experts, top_k, cfg["num_hidden_layers"]


def summarize(counts: list[int], experts: int, top_k: int, layers: int, batch: int) -> dict:
    steps = len(counts) // layers
    if steps == 0 or len(counts) % layers:
        raise RuntimeError(f"{len(counts)} routed decode calls is not a whole number of {layers}-layer steps")
    per_layer = [statistics.fmean(counts[i::layers]) for i in range(layers)]
    expected = expected_touched(experts, top_k, batch)
    mean = statistics.fmean(counts)
    return {"num_experts": experts, "top_k": top_k, "batch": batch, "decode_steps": steps,
            "expected": round(expected, 2), "mean": round(mean, 2), "min": min(counts), "max": max(counts),
            "mean_over_expected": round(mean / expected, 4), "per_layer_mean": [round(v, 2) for v in per_layer]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(PRESETS), default="qwen3.5-35b-a3b")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a preset config")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="1024x8x16", help="prompt x batch x new tokens")
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    prompt, batch, new = (int(v) for v in a.shape.split("x"))
    folder = Path(a.model) if a.model else write_checkpoint_folder(a.config, Path(tempfile.mkdtemp()) / a.config)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    experts, top_k, layers = moe_shape(cfg)
    llm = LLM(str(folder), device=a.device, dtype=a.dtype, load_format=a.load_format, skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=prompt + new + 16, max_num_seqs=batch, enforce_eager=True)
    prompts = [{"prompt_token_ids": x} for x in random_prompts(batch, prompt, cfg["vocab_size"])]
    with RouteCounter(batch) as counter:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    res = {"config": a.model or a.config, "shape": a.shape, "load_format": a.load_format,
           **summarize(counter.counts, experts, top_k, layers, batch)}
    print(f"{res['config']} {a.shape}: {res['mean']} distinct experts a layer a decode step (min {res['min']}, max "
          f"{res['max']}, over {res['decode_steps']} steps); uniform picks give {res['expected']} "
          f"({res['mean_over_expected']:.3f}x)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
