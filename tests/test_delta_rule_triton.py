"""Triton gated-delta-rule kernels against the PyTorch reference, on the CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is first imported, so the checks run as a script in a fresh
subprocess (`python tests/test_delta_rule_triton.py <group>`); pytest launches it and checks the exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(group: str, timeout: int = 300):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), group], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"group {group} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


@pytest.mark.parametrize("group", ["recurrent", "chunk"])
def test_delta_rule_kernels(group):
    _run(group)


# ---- checks (in the subprocess) ------------------------------------------------------------------

def _case(lens, hk, hv, dk, dv, init, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v = torch.randn(n, hv, dv, generator=g)
    decay = -torch.rand(n, hv, generator=g) * 1.5
    beta = torch.rand(n, hv, generator=g)
    num_slots = len(lens) + 2
    cache = torch.randn(num_slots, hv, dk, dv, generator=g) * 0.5
    for i, keep in enumerate(init):
        if not keep:
            cache[i + 1] = float("nan")  # a fresh sequence must not read its slot
    slots = [i + 1 for i in range(len(lens))]
    qsl = [0]
    for ln in lens:
        qsl.append(qsl[-1] + ln)
    return q, k, v, decay, beta, cache, slots, qsl


def _check(lens, hk, hv, dk, dv, init, chunk=16, seed=0):
    import torch

    from compiled_llm.ops.delta_rule import gated_delta_rule_with_state
    from compiled_llm.ops.triton.delta_rule import gated_delta_rule_varlen

    q, k, v, decay, beta, cache, slots, qsl = _case(lens, hk, hv, dk, dv, init, seed)
    ref_cache = cache.clone()
    ref = gated_delta_rule_with_state(q, k, v, decay, beta, ref_cache, slots, init, qsl)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    got = gated_delta_rule_varlen(q, k, v, decay, beta, cache, qsl, i32(slots), i32([int(b) for b in init]),
                                  chunk=chunk)
    err = (got - ref).abs().max().item()
    serr = (cache[slots] - ref_cache[slots]).abs().max().item()
    print(f"  lens={lens} heads={hk}/{hv} dims={dk}/{dv} chunk={chunk}: out {err:.2e} state {serr:.2e}", flush=True)
    assert err < 1e-4 and serr < 1e-4, (err, serr)
    untouched = [i for i in range(cache.shape[0]) if i not in slots]
    assert torch.equal(cache[untouched], ref_cache[untouched])


def group_recurrent():
    _check([1, 1, 3, 1], 2, 4, 16, 16, [True, False, True, True])
    _check([1, 2], 1, 1, 8, 24, [False, True])  # dims below / not a power of two


def group_chunk():
    _check([5, 40, 1, 17], 2, 4, 16, 16, [False, True, True, False], chunk=16)
    _check([33, 7], 1, 2, 32, 24, [True, False], chunk=32)
    _check([20], 2, 2, 12, 20, [True], chunk=16)


if __name__ == "__main__":
    globals()[f"group_{sys.argv[1]}"]()
