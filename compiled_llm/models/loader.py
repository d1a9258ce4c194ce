"""Weights: safetensors (single file, sharded with or without an index), memory-mapped, strict."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

log = logging.getLogger("compiled_llm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(requested: str, checkpoint_dtype: str | None) -> torch.dtype:
    if requested in (None, "auto"):
        return DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    if requested not in DTYPES:
        raise ValueError(f"unsupported dtype {requested!r}; use auto, float32, bfloat16 or float16")
    return DTYPES[requested]


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ValueError(f"checkpoint shard missing: {', '.join(missing)}")
    if not files:
        raise ValueError(f"no *.safetensors weight file in {folder}")
    return files


def load_weights(model: nn.Module, folder: Path, rename, progress: bool = True) -> None:
    """Copy every checkpoint tensor into the parameter `rename(name)` names (None: skip it; a
    (name, index) pair: into `param[index]`, e.g. one expert's slice of a packed parameter).
    A parameter with a `weight_loader` (tensor/expert-parallel layers) is handed the whole checkpoint
    tensor (or, with an index, the tensor of that index: one expert's, or its gate or up half), checked against
    `full_shape` (indexed), and copies its own slice (returning the elements written).
    Missing, unexpected or misshapen tensors raise ValueError naming them. Progress: a bar on a terminal,
    else one log line per file (a 25B checkpoint takes minutes; a log must say it is moving)."""
    params = dict(model.named_parameters())
    extra_buffers = getattr(model, "loaded_buffers", ())  # persistent buffers a model loads (media towers)
    params.update({k: v for k, v in model.named_buffers() if k.endswith("layer_scalar") or k in extra_buffers})
    loaded: dict[str, int] = {}  # parameter -> elements written
    unexpected = []
    files = checkpoint_files(folder)
    t0, num_tensors, num_bytes = time.perf_counter(), 0, 0
    log.info("loading weights: %d file(s) from %s", len(files), folder)
    bar = tqdm(total=len(files), desc="loading weights", unit="file", disable=None if progress else True)
    for i, path in enumerate(files, 1):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                ours = rename(name)
                if ours is None:
                    continue
                index = None
                if isinstance(ours, tuple):
                    ours, index = ours
                if ours not in params:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                num_tensors, num_bytes = num_tensors + 1, num_bytes + tensor.numel() * tensor.element_size()
                param = params[ours]
                loader = getattr(param, "weight_loader", None)  # split parameters take their own slice
                if loader is not None:
                    expected = param.full_shape if index is None else \
                        torch.empty(param.full_shape, device="meta")[index].shape
                    if tuple(tensor.shape) != tuple(expected):
                        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                         f"the model expects {tuple(expected)}")
                    written = loader(param, tensor) if index is None else loader(param, tensor, index)
                    loaded[ours] = loaded.get(ours, 0) + written
                    continue
                target = param if index is None else param[index]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor.to(target.dtype))
                loaded[ours] = loaded.get(ours, 0) + tensor.numel()
        bar.update(1)
        log.log(logging.DEBUG if not bar.disable else logging.INFO, "loading weights: file %d/%d %s done, "
                "%d tensors (%.2f GiB) so far, %.1fs", i, len(files), path.name, num_tensors, num_bytes / (1 << 30),
                time.perf_counter() - t0)
    bar.close()
    if unexpected:
        raise ValueError(f"unexpected weight(s) in checkpoint: {', '.join(sorted(unexpected)[:10])}")
    missing = sorted(p for p in params if loaded.get(p, 0) < params[p].numel())
    if missing:
        raise ValueError(f"weight(s) missing from checkpoint: {', '.join(missing[:10])}")
    log.info("loaded %d tensors (%.2f GiB) in %.1fs", num_tensors, num_bytes / (1 << 30), time.perf_counter() - t0)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes (benchmarks): small normals, norms near one."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            if "norm" in name or name.endswith("scale"):
                p.normal_(1.0, 0.05, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def build_model(model_cls, model_config, folder: Path, device: torch.device, dtype: torch.dtype,
                load_format: str = "auto", seed: int = 0) -> nn.Module:
    """The model on its device in the serving dtype, with its weights (the checkpoint's, or random for
    load_format dummy); logged, since a large model takes minutes here and the log is all a non-terminal run
    shows."""
    t0 = time.perf_counter()
    no_gpu = "" if torch.cuda.is_available() else " (torch sees no CUDA GPU)"
    log.info("building %s (%d layers) on %s%s in %s", model_cls.__name__, getattr(model_config, "num_hidden_layers", 0),
             device, no_gpu, str(dtype).replace("torch.", ""))
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters in the serving dtype; rope tables stay float32
    try:
        with torch.device(device):
            model = model_cls(model_config).eval()
    finally:
        torch.set_default_dtype(prev)
    if load_format == "dummy":
        log.info("random weights (--load-format dummy)")
        init_dummy_weights(model, seed)
    else:
        load_weights(model, folder, model.hf_to_ours)
    params = list(model.parameters())
    size = sum(p.numel() * p.element_size() for p in params)
    log.info("model ready in %.1fs: %.1fM parameters, %.2f GiB", time.perf_counter() - t0,
             sum(p.numel() for p in params) / 1e6, size / (1 << 30))
    return model
