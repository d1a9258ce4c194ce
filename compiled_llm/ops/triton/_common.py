"""Small Triton device helpers shared by the kernels in this package."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for a kernel's operands. Triton's default for float32 is tf32 (10-bit
    mantissa), which would make a float32 engine disagree with its own eager run wherever a fused kernel
    replaces the model's matmuls (a router picking another expert); tf32x3 gives float32-grade products on
    tensor cores. Half-precision operands ignore it."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def dot_f32(dtype: torch.dtype) -> bool:
    """Whether a kernel's tl.dot should take float32 copies of its operands: only under the Triton interpreter
    (tests on the CPU), which multiplies half-precision operands wrongly."""
    return _INTERPRETED and dtype != torch.float32


# Programmatic dependent launch between a decode layer's attention and its output projection: the split decode's
# combine kernel lets the next kernel launch as soon as it starts, and the narrow decode projection of exactly the
# combine's output (skinny_gemm.decode_mm; LAST_COMBINE below) launches with PDL, asks L2 for the first P column
# steps of its weight slice, then waits for the combine. The combine reads only L2 (the splits' partials), so the
# projection's first weight bytes come from HBM while it runs. sm_90+ only. H200, session 35 (alternating runs on
# one machine, tok/s): Gemma 4 26B-A4B batch-1 decode 313.5 / 314.1 -> 316.2 / 316.5, 1024x8x256 and 8192x4x512
# within +-0.3%; Qwen3.5 35B-A3B unchanged (its o_proj takes the attention gate first). COMPILED_LLM_DECODE_PDL=P
# sets the steps, 0 turns it off (an A/B). Not kept: every narrow decode projection launched so (Qwen3.5's out_proj
# behind the delta rule, its shared expert: -0.7% at batch 8), and the decode kernel prefetching its first key
# tiles behind the QK-norm kernel (Gemma 4 -2% at batches 4 and 8, nothing at batch 1).
DECODE_PDL_ENV = "COMPILED_LLM_DECODE_PDL"
_SM90: dict[torch.device, bool] = {}
_HOPPER: dict[torch.device, bool] = {}


def sm90(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0+ (never under the interpreter: it runs no PTX)."""
    if _INTERPRETED or device.type != "cuda":
        return False
    if device not in _SM90:
        _SM90[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _SM90[device]


def hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.x: Hopper's warpgroup MMA (wgmma), which the Gluon kernels issue
    (sm_100 has no wgmma). Never under the interpreter."""
    if _INTERPRETED or device.type != "cuda":
        return False
    if device not in _HOPPER:
        _HOPPER[device] = torch.cuda.get_device_capability(device)[0] == 9
    return _HOPPER[device]


def has_tma(device: torch.device) -> bool:
    """The device has TMA (compute capability 9.0+: sm90), or the Triton interpreter, which emulates it.
    (runtime/kernel_check.py answers for an H100/H200 while it records launches on CPU tensors.)"""
    return _INTERPRETED or sm90(device)


# the output address of the last split combine launched (combine_splits): a projection of exactly that tensor is
# the kernel right after it in stream order (decode_mm launches it with PDL; a stale match costs a PDL launch behind
# another kernel, never a wrong result: the projection still waits for the kernel before it)
LAST_COMBINE: list[int | None] = [None]


def decode_pdl_steps(device: torch.device) -> int:
    """COMPILED_LLM_DECODE_PDL's prefetched column steps on a device that can launch with PDL, else 0 (off)."""
    steps = int(os.environ.get(DECODE_PDL_ENV, "2") or 0)
    return steps if steps > 0 and sm90(device) else 0


# Self-resetting ticket counters of the kernels whose last program of a group (found by an atomic ticket) does the
# group's final work and resets the group's counter to zero: the router's token blocks, the skinny GEMM's output
# tiles. Zero between launches, so a CUDA graph replays them with no memset.
TICKETS: dict[tuple, torch.Tensor] = {}
# counters outgrown by a larger launch (a prompt with more token blocks): kept, since CUDA graphs captured with them
# still hold their address
_OUTGROWN: list[torch.Tensor] = []


def ticket_counters(key: tuple, count: int, device: torch.device) -> torch.Tensor:
    """At least `count` int32 counters for `key`, made on first use (eager: JIT warm-up or the run before a
    capture). Launches that share a key must not run at the same time on two streams: the engine runs one
    forward at a time per device, and the callers key by what they launch (the router, a weight shape)."""
    buf = TICKETS.get(key)
    if buf is None or buf.numel() < count:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = TICKETS[key] = torch.zeros(max(64, count), dtype=torch.int32, device=device)
    return buf


@triton.jit
def _dot(a, b, PREC: tl.constexpr, F32: tl.constexpr):
    # F32 (see dot_f32): float32 copies give what the GPU's half-precision dot gives (exact products, float32
    # sums); otherwise the operands go to tl.dot as they are
    if F32:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=PREC)
    return r


@triton.jit
def _tanh(x):
    # tanh(x) = 2 * sigmoid(2x) - 1; saturates cleanly for large |x| (exp -> inf gives -1, -> 0 gives 1)
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _gelu_tanh(x):
    # 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3)
    z = 1.5957691216057308 * (x + 0.044715 * x * x * x)
    return x / (1.0 + tl.exp(-z))


@triton.jit
def _reduce_angle(a):
    # Cody-Waite reduction to [-pi, pi]: 2pi = 6.28125 (exact, 8 bits) + 0.00193530717958647...
    k = tl.floor(a * 0.15915494309189535 + 0.5)
    r = a - k * 6.28125
    return r - k * 0.0019353071795864769


@triton.jit
def _gelu_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, _gelu_tanh(x).to(Y.dtype.element_ty), mask=mask)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Elementwise gelu(approximate='tanh') (mainly to test the device helper the MoE epilogue uses)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    _gelu_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
    return y
