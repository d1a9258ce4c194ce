"""The compile cache, through `python -m compiled_llm compile-cache` in fresh processes (the only honest
way to see what a start compiles): a second start, from a moved copy of the folder (no absolute paths inside),
hits, compiles nothing and is faster; a corrupted cache is rebuilt with a warning (that session driven
directly, without another engine start)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cache(model: Path, out: Path) -> dict:
    # one intra-op thread, as the test process has (tests/conftest.py): the saved forward guards on the global
    # state, and a start in this process loads it (test_loaded_forward_generates_what_eager_does)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "compiled_llm", "compile-cache", "--model", str(model), "--out", str(out),
                        "--report", "--block-size", "4", "--max-model-len", "64", "--num-kv-blocks", "64",
                        "--dtype", "float32", "--cudagraph-batch-sizes", "2", "--compile-sizes", "all"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = re.search(r"compile cache (\S+): (\w+).*start-up ([\d.]+)s", r.stdout)
    counters = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", r.stdout.split("compiles this run:")[1]))
    matches = dict(re.findall(r"^\s+(\w+)\s+.+?\s(\d+)$", r.stdout, re.M))
    aot = re.search(r"forward compiled ahead of time: (\w+)", r.stdout)
    return {"status": status.group(2), "seconds": float(status.group(3)), "counters": counters,
            "matches": matches, "aot": aot.group(1) if aot else None, "log": r.stdout + r.stderr}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tiny_models import CONFIGS, make_checkpoint

    CONFIGS.setdefault("one_layer", dict(layer_types=["full_attention"], hidden_size_per_layer_input=0))
    folder = tmp_path_factory.mktemp("gemma4_one_layer")
    make_checkpoint(folder, "one_layer")  # one layer: two pieces, the quickest to compile
    return folder


@pytest.fixture(scope="module")
def built(model, tmp_path_factory):
    cache = tmp_path_factory.mktemp("compile_cache") / "cc"
    return cache, run_cache(model, cache)


def test_round_trip_second_start_compiles_nothing_and_moves(model, built, tmp_path):
    cache, first = built
    assert first["status"] == "built"
    assert first["log"].count("passes (matches replaced") == 1  # printed by --report, not logged as well
    assert first["counters"]["fxgraph_cache_miss"] > 0 and first["counters"]["cpp_builds"] > 0
    # the static batch sizes' compiles are cacheable too (they bypassed the caches when given real tensors)
    assert first["counters"]["fxgraph_cache_bypass"] == 0 and first["counters"]["autograd_cache_bypass"] == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["files"] and manifest["report"]["pieces"] == 2

    # the traced forward is saved too (compiler/aot.py): 2 pieces x (dynamic, batch size 2) compiles
    assert first["aot"] == "saved" and (cache / "aot" / "forward.bin").is_file()
    assert first["counters"]["autograd_cache_miss"] == 2 * 2

    # nothing the cache is looked up by holds an absolute path (compiled objects keep their build folder
    # only in __FILE__ strings for error messages) ...
    for path in cache.rglob("*"):
        if path.is_file() and path.suffix != ".so":
            assert str(cache.parent).encode() not in path.read_bytes(), f"{path} holds an absolute path"
    # ... so the second start runs from a moved copy (the harder case: a start in place reads the same files, by
    # the same relative names, from the folder they were installed in): a hit that compiles and writes nothing
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(cache, moved)
    files = sorted(p.relative_to(moved) for p in moved.rglob("*"))
    second = run_cache(model, moved)
    assert second["status"] == "hit"
    assert sorted(p.relative_to(moved) for p in moved.rglob("*")) == files  # the hit wrote nothing
    # no Dynamo trace: the dynamic compiles come with the loaded forward; the static ones hit Inductor's caches
    assert second["aot"] == "loaded" and "Dynamo's trace" not in second["log"]
    c = second["counters"]
    assert c["fxgraph_cache_miss"] == 0 and c["autograd_cache_miss"] == 0 and c["cpp_builds"] == 0
    assert c["fxgraph_cache_hit"] == c["autograd_cache_hit"] == 2  # batch size 2, each piece
    assert c["fxgraph_cache_bypass"] == 0 and c["autograd_cache_bypass"] == 0
    assert "yet this start compiled" not in second["log"] and "not used" not in second["log"]
    # the start-up benchmark's phases from the same two logs (benchmarks/startup.py)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from startup import parse

    cold, warm = parse(first["log"]), parse(second["log"])
    assert (cold["cache"], cold["ahead_of_time"], warm["cache"], warm["ahead_of_time"]) == ("built", "saved", "hit", "loaded")
    assert cold["traced_nodes"] > 0 and cold["forward_saved_s"] >= 0 and "dynamo_trace_s" not in warm
    assert warm["compile_s"] == second["seconds"] and warm["counters"] == c and warm["forward_loaded_s"] >= 0
    assert 0 < warm["ready_beyond_weights_s"] and warm["kv_cache_alloc_s"] >= 0
    assert second["matches"] == first["matches"] and int(first["matches"]["qk_norm_rope_kv_write"]) == 1
    ratio = first["seconds"] / second["seconds"]
    print(f"compile-cache start-up: build {first['seconds']:.1f}s, hit {second['seconds']:.1f}s, {ratio:.1f}x faster")
    assert second["seconds"] < first["seconds"]


def test_loaded_forward_generates_what_eager_does(model, built, tmp_path):
    """A start from the cache runs the forward it loads (no Dynamo) and generates the eager model's tokens,
    prefill (dynamic compile) and decode (batch size 2's static compile) both."""
    from compiled_llm import LLM, SamplingParams

    cache = tmp_path / "cc"
    shutil.copytree(built[0], cache)
    flags = dict(block_size=4, max_model_len=64, num_kv_blocks=64, dtype="float32")  # run_cache's
    prompts, params = [[5, 9, 2, 7], [3, 3, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(model), compile_cache=str(cache), cudagraph_batch_sizes="2", compile_sizes="all", **flags)
    compiler = llm.engine.executor.runner.compiler
    assert compiler.cache.status == "hit" and compiler.summary()["ahead_of_time"] == "loaded"
    assert compiler.compiled.backend.traced_nodes > 0 and len(compiler.compiled.backend.pieces) == 2
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    eager = LLM(str(model), enforce_eager=True, **flags)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_corrupt_cache_is_rebuilt_with_a_warning(built, tmp_path, caplog):
    """A file whose hash differs from the manifest's: the cache is not used; the start builds into a fresh folder
    (what Inductor and Triton write during the session), installs it in place of the corrupt one with a warning,
    and the result is valid. The session is driven directly (an engine start builds the same way, above)."""
    import logging

    import torch

    from compiled_llm.compiler.cache import CompileCache

    cache = tmp_path / "cc"
    shutil.copytree(built[0], cache)
    victim = next(p for p in sorted(cache.rglob("*.py")) if "inductor" in p.parts)
    victim.write_text(victim.read_text() + "\n# edited\n")
    parts = json.loads((cache / "manifest.json").read_text())["parts"]
    cc = CompileCache(cache, parts["model_config"], parts["flags"], torch.device("cpu"))
    assert cc.check().startswith("corrupt:") and "does not match its hash" in cc.check()
    with caplog.at_level(logging.WARNING, logger="compiled_llm"):
        with cc.session(lambda: {"pieces": 2}):
            inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
            assert cache not in inductor.parents  # not the corrupt folder
            (inductor / "rebuilt.py").write_text("# compiled again\n")
    assert cc.status == "rebuilt"
    assert any(re.search(r"compile cache .* is corrupt: .* does not match its hash; rebuilding", r.getMessage())
               for r in caplog.records)
    assert cc.check() is None  # the rebuilt cache is valid
    assert (cache / "inductor" / "rebuilt.py").exists() and not (cache / victim.relative_to(cache)).exists()


def test_triton_kernels_built_in_a_session_are_found_after_the_folder_moves(tmp_path):
    """Triton names the files of a cached kernel by absolute path in a group file; a cache built in its
    temporary folder, installed by rename and then copied elsewhere must still hit (the H200 warm start
    rebuilt all 35 of our Triton kernels because of this). Triton's own cache manager API, no GPU needed."""
    import torch
    from triton.runtime.cache import FileCacheManager, get_cache_manager

    from compiled_llm.compiler.cache import CompileCache

    key = "ab" * 32

    def lookup() -> dict | None:
        return get_cache_manager(key).get_group("kernel.json")

    first = CompileCache(tmp_path / "cc", {"layers": 1}, {}, torch.device("cpu"))
    with first.session(lambda: {}):
        manager = get_cache_manager(key)
        paths = {name: manager.put(b"binary " + name.encode(), name) for name in ("kernel.json", "kernel.cubin")}
        manager.put_group("kernel.json", paths)
        assert lookup() == paths
    assert first.status == "built"
    moved = tmp_path / "elsewhere" / "cc"
    shutil.copytree(tmp_path / "cc", moved)
    shutil.rmtree(tmp_path / "cc")
    again = CompileCache(moved, {"layers": 1}, {}, torch.device("cpu"))
    with again.session(lambda: {}):
        assert again.status == "hit"
        found = lookup()
        assert set(found) == {"kernel.json", "kernel.cubin"}
        assert all(Path(p).parent.parent == moved / "triton" and Path(p).read_bytes().startswith(b"binary")
                   for p in found.values())
        # what Triton's default manager answers here: a miss (each child's recorded path is gone)
        assert not (FileCacheManager(manager.key).get_group("kernel.json") or {}).get("kernel.json")
    assert "TRITON_CACHE_MANAGER" not in os.environ


def test_saved_forward_keeps_structural_guards_and_drops_tensor_matches():
    """The guards saved with the forward: none on tensors' properties (torch 2.11 saved dispatch keys that live
    tensors do not have, so a loaded forward refused every call), none on globals; the rest stay."""
    from types import SimpleNamespace

    from compiled_llm.compiler.aot import saved_guards

    def entry(name, kind, is_global=False):
        return SimpleNamespace(name=name, guard_type=kind, is_global=is_global)

    entries = [entry("input_ids", "TENSOR_MATCH"), entry("self._modules['model']._parameters['w']", "TENSOR_MATCH"),
               entry("self._modules['model']", "TYPE_MATCH"), entry("self.config.num_layers", "EQUALS_MATCH"),
               entry("G['flag']", "EQUALS_MATCH", is_global=True), entry("", "SHAPE_ENV")]
    assert saved_guards(entries) == [False, False, True, True, False, True]


def test_a_start_refused_after_the_cache_opened_leaves_no_cache_and_no_variables(model, tmp_path, monkeypatch):
    """On a GPU the compile cache opens before the profile step (its kernels build into it); a start refused
    after that (here: a KV cache too small for max_model_len) closes it as on an error: nothing installed, no
    build folder left, Inductor's and Triton's cache variables as they were."""
    from compiled_llm import LLM
    from compiled_llm.runtime.model_runner import ModelRunner

    plan = ModelRunner.plan_blocks

    def plan_after_opening(self, max_model_len):  # what profile_run does on a GPU
        self.compiler.begin()
        assert self.compiler.cache is not None and os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path))
        return plan(self, max_model_len)

    monkeypatch.setattr(ModelRunner, "plan_blocks", plan_after_opening)
    before = {v: os.environ.get(v) for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    with pytest.raises(ValueError, match="KV cache holds"):
        LLM(str(model), compile_cache=str(tmp_path / "cc"), block_size=4, max_model_len=64, num_kv_blocks=4,
            dtype="float32")
    assert {v: os.environ.get(v) for v in before} == before
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []
