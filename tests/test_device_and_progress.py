"""--device auto everywhere, and start-up that says what it is doing in a log that is not a terminal.

A GPU is simulated by replacing torch.cuda.is_available / device_count: what is tested is our decision
(which device a config resolves to, which error a bad one gives), not torch."""

from __future__ import annotations

import io
import logging
import re
import os
import subprocess
import sys

import pytest
import torch

from compiled_llm import LLM
from compiled_llm.cli import build_parser, main
from compiled_llm.config import EngineConfig, config_from_args


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


class _Stderr(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


# ---- --device auto ---------------------------------------------------------------------------------
def test_auto_is_cuda_when_torch_sees_a_gpu_else_cpu(monkeypatch):
    _gpus(monkeypatch, 1)
    assert EngineConfig().device == "cuda"
    assert EngineConfig(device="Auto").device == "cuda"
    assert EngineConfig(device="cpu").device == "cpu"  # an explicit choice stands
    _gpus(monkeypatch, 0)
    assert EngineConfig().device == "cpu"


@pytest.mark.parametrize("argv", [["generate", "hi"], ["serve"], ["compile-cache", "--out", "x"]])
def test_every_command_defaults_to_auto(argv, monkeypatch):
    args = build_parser().parse_args(argv)
    assert args.device == "auto"
    _gpus(monkeypatch, 2)
    assert config_from_args(args).device == "cuda"
    _gpus(monkeypatch, 0)
    assert config_from_args(args).device == "cpu"


def test_llm_defaults_to_auto(monkeypatch):
    import compiled_llm.runtime.llm as llm_module

    built = []
    monkeypatch.setattr(llm_module, "LLMEngine", built.append)  # the config LLM builds its engine from
    _gpus(monkeypatch, 1)
    LLM(model="/some/checkpoint")
    _gpus(monkeypatch, 0)
    LLM(model="/some/checkpoint")
    assert [c.device for c in built] == ["cuda", "cpu"]


def test_bad_devices_are_one_line_errors(monkeypatch, capsys):
    _gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        EngineConfig(device="cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        EngineConfig(device="meta")
    _gpus(monkeypatch, 2)
    assert EngineConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="torch sees 2 GPU"):
        EngineConfig(device="cuda:2")
    with pytest.raises(ValueError, match="gpu_memory_utilization must lie in"):
        EngineConfig(gpu_memory_utilization=1.5)
    _gpus(monkeypatch, 0)
    assert main(["generate", "--device", "cuda", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: device 'cuda' was asked for, but torch sees no CUDA GPU")


def test_compile_cache_dry_run_audits_the_gpu_graph_by_default_without_a_gpu(tiny_ckpt, monkeypatch, capsys):
    """The dry run traces fake tensors: --device names the graph to audit (auto: the GPU's), and neither auto
    nor cuda needs a GPU here."""
    import compiled_llm.runtime.audit as audit_module

    folder, _ = tiny_ckpt("dense")
    seen = []

    def fake_audit(hf, *, device, tokens, **kw):
        seen.append((device.type, tokens))
        return type("Report", (), {"mismatches": [], "text": lambda self: "audit"})()

    monkeypatch.setattr(audit_module, "audit", fake_audit)
    _gpus(monkeypatch, 0)
    for device in ("auto", "cuda", "cpu"):
        assert main(["compile-cache", "--dry-run", "--model", str(folder), "--device", device]) == 0
    assert main(["compile-cache", "--dry-run", "--model", str(folder), "--max-num-batched-tokens", "512"]) == 0
    # the per-step token budget is the target's default (a GPU server's 8192, as vLLM and SGLang on an H200),
    # not this CPU machine's 2048, unless given
    assert seen == [("cuda", 8192), ("cuda", 8192), ("cpu", 2048), ("cuda", 512)]


@pytest.mark.parametrize("command", ["generate", "serve", "compile-cache"])
def test_help_says_auto_and_what_gpu_memory_utilization_means(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    text = " ".join(sub.format_help().split())
    assert "auto (cuda when torch sees a GPU, else cpu)" in text and "(default: auto)" in text
    assert "fraction of the GPU's total memory this engine may use" in text


# ---- progress in a log -----------------------------------------------------------------------------
class _FakeCompiled:
    """What warm_up drives: two static sizes, no whole-graph decode; records the forwards."""

    sizes = [1, 2]
    full_graph_ok = False

    def __init__(self):
        self.calls = []

    def bucket_for(self, n):
        return next((s for s in self.sizes if s >= n), None)

    def __call__(self, input_ids, positions):
        self.calls.append(input_ids.shape[0])


@pytest.mark.parametrize("tty", [False, True])
def test_warm_up_logs_every_item_when_no_bar_shows(tty, monkeypatch, caplog):
    from compiled_llm.compiler import warmup

    monkeypatch.setattr(warmup, "kernel_keys", lambda facts: [])
    stderr = _Stderr(tty)
    monkeypatch.setattr(sys, "stderr", stderr)
    model = _FakeCompiled()
    with caplog.at_level(logging.DEBUG, logger="compiled_llm"):
        warmup.warm_up(model, {}, {}, 4, 8, {}, "cpu", context_factory=lambda s, t: object())
    assert model.calls == [3, 2, 1]  # the prefill compile, then each size, largest first
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith("JIT warm-up")]
    assert [m.split(" (")[0] for _, m in lines] == [
        "JIT warm-up 1/3: compile", "JIT warm-up 2/3: batch size 2", "JIT warm-up 3/3: batch size 1"]
    # a terminal shows the bar (and the lines only at debug level); a log gets the lines at INFO, no bar
    assert {lvl for lvl, _ in lines} == {logging.DEBUG if tty else logging.INFO}
    assert ("JIT warm-up" in stderr.getvalue()) == tty


def test_weight_loading_logs_files_and_tensor_counts(tiny_ckpt, monkeypatch, caplog):
    from safetensors import safe_open

    from compiled_llm.models.gemma4 import Gemma4ForCausalLM
    from compiled_llm.models.loader import load_weights
    from compiled_llm.runtime.model_runner import read_hf_config

    folder, _ = tiny_ckpt("dense")
    model = Gemma4ForCausalLM(Gemma4ForCausalLM.config_from_hf(read_hf_config(folder)))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        expected = sum(model.hf_to_ours(k) is not None for k in f.keys())
    monkeypatch.setattr(sys, "stderr", _Stderr(False))
    with caplog.at_level(logging.INFO, logger="compiled_llm"):
        load_weights(model, folder, model.hf_to_ours)
    text = "\n".join(caplog.messages)
    assert f"file 1/1 model.safetensors done, {expected} tensors" in text
    assert f"loaded {expected} tensors" in text


def test_engine_start_logs_its_phases(tiny_ckpt, monkeypatch, caplog):
    folder, _ = tiny_ckpt("dense")
    _gpus(monkeypatch, 0)
    with caplog.at_level(logging.INFO, logger="compiled_llm"):
        LLM(str(folder), enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    text = "\n".join(caplog.messages)
    for phase in ("building Gemma4ForCausalLM (4 layers) on cpu (torch sees no CUDA GPU) in float32",
                  "loaded ", "model ready in ", "allocating the KV cache: "):
        assert phase in text, phase
    assert re.search(r"allocating the KV cache: (0\.\d\d|1\.00) MiB", text), text  # MiB, not "0.00 GiB"


# ---- no CUDA warning on a CPU start ----------------------------------------------------------------
_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO)
if sys.argv[1] == "1":
    from compiled_llm.runtime.model_runner import quiet_cpp_extension_import
    quiet_cpp_extension_import()
import torch.utils.cpp_extension  # what Inductor's C++ build does on the CPU
"""


def test_cpu_start_does_not_warn_about_a_missing_cuda_runtime(tmp_path):
    """torch warns "No CUDA runtime is found" when the CUDA toolkit is present (here: CUDA_HOME) and no GPU
    is usable; the runner imports that module quietly before Inductor does. Without it, the warning shows
    (the control run), so the check can fail."""
    env = dict(os.environ, CUDA_HOME=str(tmp_path), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(p) for p in sys.path if p]))
    runs = [subprocess.run([sys.executable, "-c", _SCRIPT, quiet], capture_output=True, text=True, env=env,
                           timeout=300) for quiet in ("0", "1")]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert "No CUDA runtime is found" in runs[0].stderr
    assert "No CUDA runtime is found" not in runs[1].stderr


def test_warmup_plan_ends_with_the_largest_step_on_cuda_only(monkeypatch):
    """On CUDA warm-up runs the max_num_batched_tokens step once more after the captures, so that the first full
    step a server runs finds the caching allocator grown (start-up's memory profile emptied it)."""
    from compiled_llm.compiler.warmup import PEAK_STEP_ENV, warmup_plan

    kw = dict(full_graph_ok=True, lone_token_bucket=True)
    cuda = warmup_plan([1, 2, 4, 512], 8192, 4, cuda=True, **kw)
    assert cuda == [("compile (513-token prefill, dynamic token count)", "prefill", 513),
                    ("prefill size 512", "prefill", 512),
                    ("batch size 4", "decode", 4), ("whole-graph decode 4", "whole", 4),
                    ("batch size 2", "decode", 2), ("whole-graph decode 2", "whole", 2),
                    ("batch size 1", "decode", 1), ("whole-graph decode 1", "whole", 1),
                    ("allocator (8192-token step)", "prefill", 8192)]
    assert warmup_plan([1, 2, 4, 512], 8192, 4, cuda=False, **kw) == cuda[:-1]
    assert warmup_plan([1, 2, 4, 512], 513, 4, cuda=True, **kw) == [  # the compile's prefill was the largest
        ("compile (513-token prefill, dynamic token count)", "prefill", 513)] + cuda[1:-1]
    monkeypatch.setenv(PEAK_STEP_ENV, "0")
    assert warmup_plan([1, 2, 4, 512], 8192, 4, cuda=True, **kw) == cuda[:-1]
