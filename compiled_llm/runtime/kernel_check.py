"""The engine's Triton kernels built for an H100/H200 (sm_90) on any machine, no GPU needed.

The Triton interpreter (TRITON_INTERPRET=1, the CPU tests) runs a kernel's Python, not Triton's compiler, so a
kernel can pass it and still fail to build on the GPU: in session 34 a jitted helper that returned differently
shaped tensors from its two constexpr branches passed every interpreter test and failed its first H200 build.
Triton's wheel carries the whole NVIDIA tool chain (its MLIR passes, LLVM, ptxas), so a kernel compiles to
PTX and a cubin here. This module replays what start-up warm-up does (compiler/warmup.py): every JIT kernel key
the providers chosen for an H100/H200 register for a model (ops/jit.py), each key's compile function run on CPU
tensors with Triton's launches recorded instead of run, and each recorded launch built for sm_90 through
Triton's own argument binder (the same specialisation of ints and 16-byte alignment as a GPU launch). Per
kernel: shared memory, and from ptxas, registers and spilled bytes, and whether the products are Hopper's
warpgroup MMA (wgmma) or the warp-level mma.sync.

`python -m compiled_llm compile-cache --dry-run --kernels --model DIR` prints the table; tests run it on the
released configs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from compiled_llm.ops.registry import Capabilities

SM90 = ("cuda", 90, 32)  # an H100 / H200: (backend, compute capability, warp size)
H100_CAPS = Capabilities("cuda", (9, 0), frozenset({"triton"}))  # the providers resolved as there (no FlashInfer)
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


@dataclasses.dataclass
class Launch:
    kernel: object  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict
    source: str = ""  # the JIT kernel key whose compile function launched it
    grid: object = None  # the launch grid (a tuple, or a function of the launch's meta-parameters)

    @property
    def name(self) -> str:
        return self.kernel.__name__


@dataclasses.dataclass
class Built:
    launch: Launch
    shared: int = 0
    registers: int = 0
    spilled: int = 0  # bytes of spill stores
    wgmma: int = 0
    mma_sync: int = 0
    error: str = ""

    def row(self) -> str:
        if self.error:
            return f"{self.launch.name:<28} FAILED {self.error}"
        return (f"{self.launch.name:<28} {self.shared / 1024:7.1f} KiB {self.registers:4d} regs {self.spilled:5d} B spilled"
                f"  {'wgmma' if self.wgmma else 'mma.sync' if self.mma_sync else '-':<8}  ({self.launch.source})")


@contextlib.contextmanager
def recorded_launches(as_sm90: bool = False):
    """Within: Triton launches are recorded (kernel, arguments, options) into the yielded list, not run.
    as_sm90: the wrappers' device checks answer as an H100/H200 would for CPU tensors (ops/triton/_common.py sm90:
    the MoE kernels' TMA, the decode projection's programmatic dependent launch; hopper: the Gluon prefill)."""
    from triton.runtime.jit import JITFunction

    from compiled_llm.ops.triton import _common

    launches: list[Launch] = []
    run, sm90, hopper = JITFunction.run, _common.sm90, _common.hopper

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs, grid=grid))

    JITFunction.run = record
    if as_sm90:
        _common.sm90 = _common.hopper = lambda device: True
    try:
        yield launches
    finally:
        JITFunction.run, _common.sm90, _common.hopper = run, sm90, hopper


def build_sm90(launch: Launch):
    """The launch's kernel built for sm_90: Triton's CompiledKernel (asm: ttir ... ptx, cubin; metadata.shared).
    Raises Triton's CompilationError where a GPU's build would. A Gluon kernel (@gluon.jit) builds from its own
    source class."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget(*SM90)
    fn, backend = launch.kernel, make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    return triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spilled bytes) from the ptxas in Triton's wheel (-v), for sm_90a."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else 0, int(spill.group(1)) if spill else 0


def check_launch(launch: Launch, usage: bool = True) -> Built:
    try:
        k = build_sm90(launch)
    except Exception as e:  # noqa: BLE001 - reported per kernel: the table shows every failure, not the first
        return Built(launch, error=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
    ptx = k.asm["ptx"]
    regs, spilled = ptxas_usage(ptx) if usage else (0, 0)
    return Built(launch, shared=k.metadata.shared, registers=regs, spilled=spilled,
                 wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"))


def distinct(launches: list[Launch]) -> list[Launch]:
    """One launch per build Triton would make: the kernel, its constexprs' values and launch options, and its
    other arguments' specialisation (dtype and 16-byte alignment, ints equal to 1 or divisible by 16)."""
    seen, out = set(), []
    for lz in launches:
        params = lz.kernel.params
        args = tuple(_spec_key(v, params[i]) for i, v in enumerate(lz.args))
        named = {p.name: p for p in params}
        kwargs = tuple(sorted((k, _spec_key(v, named.get(k))) for k, v in lz.kwargs.items()))
        sig = (lz.kernel, args, kwargs)
        if sig not in seen:
            seen.add(sig)
            out.append(lz)
    return out


def _spec_key(v, param):
    if param is None or param.is_constexpr:  # a constexpr or a launch option: its value
        return repr(v)
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return ("int",) if param.do_not_specialize else ("int", v == 1, v % 16 == 0, v >= 2 ** 31)
    if isinstance(v, float):
        return "float"
    return repr(v)


@contextlib.contextmanager
def h100_facts(hf_config: dict, dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
               max_num_batched_tokens: int = 8192):
    """Within: the providers chosen as on an H100/H200 for this model (built on the meta device); yields the model
    facts start-up warm-up takes (compiler/warmup.py kernel_keys, precompile_kernels)."""
    from compiled_llm.models.interfaces import recurrent_state_specs
    from compiled_llm.models.registry import resolve_model_class
    from compiled_llm.ops.registry import model_facts, preserved_choices, select_providers
    from compiled_llm.runtime.kv_plan import mark_rot_keys

    model_cls = resolve_model_class(hf_config)
    cfg = model_cls.config_from_hf(hf_config)
    with preserved_choices():
        with torch.device("meta"):
            model = model_cls(cfg)
        specs = model.attention_specs()
        mark_rot_keys(specs)  # as the engine marks them before its cache and warm-up (its default)
        facts = model_facts(cfg, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens, tp_size=1,
                            states=recurrent_state_specs(model))
        select_providers(torch.device("cuda"), dtype, specs, facts, caps=H100_CAPS)
        yield dict(facts, dtype=dtype, layers=specs)


def engine_launches(hf_config: dict, dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
                    max_num_batched_tokens: int = 8192, only: set[str] | None = None) -> list[Launch]:
    """Every Triton launch start-up warm-up makes for this model on an H100/H200 (the providers chosen for
    it, each registered JIT key's compile function), recorded on the CPU."""
    from compiled_llm.compiler.warmup import kernel_keys

    out: list[Launch] = []
    with h100_facts(hf_config, dtype, block_size, max_num_batched_tokens) as facts:
        for kernel, key in kernel_keys(facts):
            if kernel.provider != "triton" or (only and kernel.name not in only):
                continue
            with recorded_launches(as_sm90=True) as launches, torch.inference_mode():
                kernel.compile(key, torch.device("cpu"))
            for lz in launches:
                lz.source = f"{kernel.name} {key!r}"[:120]
            out.extend(launches)
    return distinct(out)


def check_model(hf_config: dict, dtype: torch.dtype = torch.bfloat16, usage: bool = True, block_size: int = 16,
                max_num_batched_tokens: int = 8192, only: set[str] | None = None) -> list[Built]:
    """Each distinct launch of engine_launches, built for sm_90 (usage: with ptxas's registers and spills), on
    every core (Triton's compiler releases the GIL: two threads halve a model's ~35 s on two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    from compiled_llm.ops.jit import serial_ast_parse

    launches = engine_launches(hf_config, dtype, block_size, max_num_batched_tokens, only=only)
    with serial_ast_parse(), ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(lambda lz: check_launch(lz, usage), launches))
