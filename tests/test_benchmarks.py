"""The benchmark scripts run on the CPU at tiny sizes and report self-consistent numbers
(their GPU figures live in benchmarks/NOTES.md; nothing here is a speed claim)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from compiled_llm import LLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import floor  # noqa: E402
from configs import config_dict, qwen_layer_types, write_config_folder  # noqa: E402
from side_by_side import run_side_by_side  # noqa: E402


def test_floor_of_the_26b_shape_matches_the_known_figure():
    cfg = config_dict("gemma-4-26b-a4b")
    tok_s = 8 * 256 / floor.floor_seconds(cfg, 1024, 8, 256, 4.27e12, 790e12)
    assert 1200 < tok_s < 1400  # the issue quotes about 1,290 tok/s for 1K/8/256
    # more sequences touch more experts; more context reads more KV
    assert floor.decode_step_bytes(cfg, 8, 1024) > floor.decode_step_bytes(cfg, 1, 1024)
    assert floor.decode_step_bytes(cfg, 1, 32768) > floor.decode_step_bytes(cfg, 1, 1024)


# hidden 8; layers: linear then full; full attention 2 heads, 1 KV head, head_dim 4; linear attention 1 key head,
# 2 value heads, key dim 2, value dim 3, conv kernel 3; 4 experts top-2, expert width 5, shared expert width 6
TINY_QWEN = {
    "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 10,
    "hidden_size": 8, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "linear_num_key_heads": 1,
    "linear_num_value_heads": 2, "linear_key_head_dim": 2, "linear_value_head_dim": 3, "linear_conv_kernel_dim": 3,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 5, "shared_expert_intermediate_size": 6,
    "tie_word_embeddings": False,
}


def test_qwen_floor_matches_a_hand_count():
    lm_head = 10 * 8
    full = 8 * (2 * 8 + 4 + 4) + 8 * 8  # q_proj with gate (2 x 2 heads x 4), k, v; o_proj
    conv_dim = 2 * 2 + 6  # q, k (1 head x 2) and v (2 heads x 3)
    linear = 8 * (conv_dim + 6 + 2 + 2) + 6 * 8 + conv_dim * 3  # in_proj qkv, z, b, a; out_proj; conv
    shared = 3 * 8 * 6 + 8  # shared expert and its gate
    # decode, batch 2, context 7: 4 * (1 - (1 - 2/4) ** 2) = 3 experts touched per layer
    moe = 3 * (3 * 5 * 8) + 8 * 4 + shared
    kv = 2 * 7 * (2 * 1 * 4)  # full layer's K and V
    state = 2 * (2 * (2 * 2 * 3) * 4 + 2 * conv_dim * 2 * 2)  # float32 state and bf16 conv window, read + write
    expected = (lm_head + full + linear + 2 * moe + kv) * 2 + state
    assert floor.decode_step_bytes(TINY_QWEN, 2, 7) == pytest.approx(expected)
    assert expected == 3900

    # prefill, batch 2, prompt 4: top-2 experts per token, causal attention, chunked delta rule
    per_token = lm_head / 4 + full + linear + 2 * (2 * (3 * 5 * 8) + 8 * 4 + shared)
    attention = 2 * 2 * 2 * 4 * 4 * 4 / 2
    delta = 2 * 4 * 2 * (3 * 2 * 3 + 64 * (3 * 2 + 2 * 3))  # 2 x tokens x value heads x multiply-adds per head
    expected = 2 * per_token * 2 * 4 + (attention + delta) * 2
    assert floor.prefill_flops(TINY_QWEN, 2, 4) == pytest.approx(expected)
    assert expected == 47456

    # the nested (conditional-generation) layout counts the same; floor_seconds adds prefill and decode
    nested = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "text_config": {k: v for k, v in TINY_QWEN.items() if k != "architectures"}}
    assert floor.decode_step_bytes(nested, 2, 7) == floor.decode_step_bytes(TINY_QWEN, 2, 7)
    seconds = floor.floor_seconds(TINY_QWEN, 4, 2, 3, bandwidth=100.0, flops=1000.0)
    assert seconds == pytest.approx(47456 / 1000 + sum(floor.decode_step_bytes(TINY_QWEN, 2, c) / 100 for c in (5, 6)))


def test_qwen_preset_floor_is_about_three_billion_active_parameters():
    cfg = config_dict("qwen3.5-35b-a3b")
    assert floor.decode_step_bytes(cfg, 1, 1) / 2 == pytest.approx(3.0e9, rel=0.1)
    assert floor.decode_step_bytes(cfg, 8, 1024) > floor.decode_step_bytes(cfg, 1, 1024)
    assert floor.decode_step_bytes(cfg, 1, 32768) > floor.decode_step_bytes(cfg, 1, 1024)


def test_throughput_accepts_the_qwen_preset():
    import throughput

    assert throughput.build_parser().parse_args(["--config", "qwen3.5-35b-a3b"]).config == "qwen3.5-35b-a3b"


def test_shrunken_qwen_preset_runs_with_dummy_weights(tmp_path):
    """The preset's layout with fewer layers, experts and heads (head_dim stays 256: the M-RoPE section
    needs its 32 rotary frequencies) loads with random weights and generates; transformers' peer takes our
    weights as they are."""
    import throughput

    cfg = dict(config_dict("qwen3.5-35b-a3b"), num_hidden_layers=4, layer_types=qwen_layer_types(4), hidden_size=64,
               vocab_size=512, num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
               moe_intermediate_size=32, shared_expert_intermediate_size=32)
    folder = write_config_folder(cfg, tmp_path / "qwen3.5-small")
    throughput.main(["--model", str(folder), "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
                     "--shapes", "8x2x4", "--warmup", "0", "--runs", "1", "--enforce-eager", "--peer", "transformers",
                     "--peer-warmup", "0", "--peer-runs", "1", "--out", str(tmp_path / "out")])
    row = json.loads(next((tmp_path / "out").glob("throughput_*.json")).read_text())["rows"][0]
    assert row["shape"] == "8x2x4" and row["ours_tok_s"] > 0 and row["transformers_tok_s"] > 0


def test_throughput_script_on_a_tiny_checkpoint(tiny_ckpt, tmp_path):
    import throughput

    folder, _ = tiny_ckpt("dense")
    throughput.main(["--model", str(folder), "--load-format", "auto", "--device", "cpu", "--dtype", "float32",
                     "--shapes", "16x2x8", "--warmup", "0", "--runs", "2", "--enforce-eager", "--out", str(tmp_path)])
    result = json.loads(next(tmp_path.glob("throughput_*.json")).read_text())
    row = result["rows"][0]
    assert row["shape"] == "16x2x8" and row["ours_tok_s"] > 0 and row["floor_tok_s"] is None
    import torch
    import transformers

    # the versions the figures came from (a peer's speed moves with its version)
    assert torch.__version__.startswith(result["versions"]["torch"])
    assert result["versions"]["transformers"] == transformers.__version__


def test_latency_script_on_a_tiny_checkpoint(tiny_ckpt, tmp_path):
    import latency

    folder, _ = tiny_ckpt("dense")
    res = latency.main(["--model", str(folder), "--load-format", "auto", "--device", "cpu", "--dtype", "float32",
                        "--ttft-lengths", "8,64", "--decode-context", "8", "--decode-tokens", "8", "--warmup", "0",
                        "--runs", "3", "--enforce-eager", "--profile-dir", str(tmp_path), "--host-profile",
                        "--alternate-env", "COMPILED_LLM_TEST_AB=x,y"])
    assert set(res["ttft_ms"]) == {8, 64} and all(v > 0 for v in res["ttft_ms"].values())
    # the A/B in one engine: each value's runs, and the variable unset again afterwards
    alt = res["ttft_alternating"][64]
    assert set(alt) == {"x", "y"} and all(len(v["runs_ms"]) == 3 and v["median_ms"] > 0 for v in alt.values())
    assert "COMPILED_LLM_TEST_AB" not in os.environ
    assert len(res["ttft_runs_ms"][64]) == 3 and isinstance(res["gc_pauses"][64], dict)
    assert res["decode_ms_per_token"] > 0 and set(res["decode_alternating_ms_per_token"]) == {"x", "y"}
    # the prefill profile: a table per length and its wall time (no GPU here: no kernels, none busy)
    assert set(res["prefill_profile"]) == {8, 64} and res["prefill_profile"][64]["wall_ms"] > 0
    assert "aten::" in (tmp_path / "prefill_64.txt").read_text()
    # and the kernels in launch order (none on the CPU), the attention's per layer among them
    assert (tmp_path / "prefill_64_sequence.txt").read_text() == "" and res["prefill_profile"][64]["attention_us"] == []
    # the host side: cProfile's table names the engine's step; no device here, so no syncs to list
    assert res["host_profile"][64]["device_syncs"] == 0
    assert "compiled_llm/runtime/engine.py" in (tmp_path / "host_64.txt").read_text()


def test_first_wave_script_times_each_wave_on_the_thread_asked(tiny_ckpt, tmp_path):
    import threading

    import first_wave

    folder, _ = tiny_ckpt("dense")
    threads = []
    real = first_wave.waves
    first_wave.waves = lambda *a: (threads.append(threading.current_thread().name), real(*a))
    try:
        res = first_wave.main(["--model", str(folder), "--load-format", "auto", "--device", "cpu", "--dtype", "float32",
                               "--waves", "2", "--batch", "2", "--input-len", "8", "--output-len", "3", "--thread",
                               "--out", str(tmp_path / "fw.json")])
    finally:
        first_wave.waves = real
    assert threads == ["engine"]  # not the main thread, which built the engine
    assert [set(w) for w in res["waves"]] == [{"ms"}, {"ms"}] and all(w["ms"] > 0 for w in res["waves"])
    assert json.loads((tmp_path / "fw.json").read_text())["waves"] == res["waves"]


def test_rebuild_script_builds_engines_one_after_another(tiny_ckpt, tmp_path):
    import rebuild

    folder, _ = tiny_ckpt("moe")
    res = rebuild.main(["--model", str(folder), "--load-format", "auto", "--device", "cpu", "--dtype", "float32",
                        "--builds", "2", "--max-model-len", "32", "--enforce-eager", "--out", str(tmp_path / "r.json")])
    first, second = res["builds"]
    assert first["kv_blocks"] == second["kv_blocks"] > 0 and first["tokens"] == second["tokens"]
    assert all(b["built_bytes"] > 0 and b["after_delete_bytes"] > 0 for b in res["builds"])
    assert json.loads((tmp_path / "r.json").read_text())["builds"] == res["builds"]


def test_scoring_script_times_a_scored_prompt_beside_a_plain_one(tiny_ckpt, tmp_path):
    import scoring

    folder, _ = tiny_ckpt("dense")
    res = scoring.main(["--model", str(folder), "--load-format", "auto", "--device", "cpu", "--dtype", "float32",
                        "--prompt-len", "40", "--runs", "1", "--max-model-len", "64", "--enforce-eager",
                        "--out", str(tmp_path / "s.json")])
    (row,) = res["runs"]
    assert row["entries"] == 40 and row["plain_s"] > 0 and row["scoring_s"] > 0
    assert json.loads((tmp_path / "s.json").read_text())["runs"] == res["runs"]


def test_server_steps_logs_each_hand_over_and_step(tmp_path, monkeypatch):
    import asyncio
    import pstats

    import server_steps
    from server_utils import FakeEngine

    from compiled_llm.sampling_params import SamplingParams
    from compiled_llm.server import async_engine
    from compiled_llm.server.generation import Generation

    for name in ("_add", "_run", "start"):  # install() replaces them on the class: put them back afterwards
        monkeypatch.setattr(async_engine.AsyncEngine, name, getattr(async_engine.AsyncEngine, name))
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("STEP_LOG", str(log))
    monkeypatch.setenv("STEP_PROFILE", "1")  # each wave's first step under cProfile
    monkeypatch.setattr(server_steps, "IDLE_S", 0.05)
    server_steps.install()

    async def main():
        aengine = async_engine.AsyncEngine(FakeEngine())
        aengine.start()
        await asyncio.sleep(0.01)  # as a server's lifespan starts it before any request
        for wave in range(2):
            gens = [Generation(aengine, f"r{wave}{i}", [f"prompt {i}"], SamplingParams(max_tokens=4))
                    for i in range(2)]
            for g in gens:
                await g.start()
            await asyncio.gather(*(g.run() for g in gens))
            await asyncio.sleep(0.15)  # idle: the next step starts wave 2
        await aengine.stop()

    asyncio.run(main())
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    adds, steps = [x for x in lines if x[0] == "add"], [x for x in lines if x[0] == "step"]
    assert len(adds) == 4 and all(posted <= taken <= done for _, posted, taken, done in adds)
    assert len(steps) >= 8 and all(start <= end for _, start, end, _ in steps)
    assert sum(n for *_, n in steps) >= 4 * 4  # every token of every request came out of a logged step
    profiles = sorted(p.name for p in tmp_path.glob("steps.jsonl.wave*.prof"))
    assert profiles[:4] == ["steps.jsonl.wave1.loop.prof", "steps.jsonl.wave1.step1.prof",
                            "steps.jsonl.wave2.loop.prof", "steps.jsonl.wave2.step1.prof"]
    loop_first = pstats.Stats(str(tmp_path / profiles[0])).stats  # the event loop's thread: the requests' side
    assert any(name == "start" and "generation.py" in file for file, _, name in loop_first)
    first, second = (str(tmp_path / p) for p in profiles[1:4:2])
    rows = server_steps.diff(first, second)
    assert rows and any("step" in name for *_, name in rows)  # FakeEngine.step's own frame is in both
    assert all(d == 0 for d, *_ in server_steps.diff(first, first))


def test_gc_pauses_counts_a_collection():
    import gc

    import latency

    with latency.GCPauses() as p:
        gc.collect(1)
    assert p.summary()["gen1"][0] == 1


def test_grouped_mm_moe_matches_a_loop_over_the_pairs():
    """benchmarks/grouped_mm_moe.py's torch._grouped_mm pipeline (CPU: torch's own fallback) against each pick's
    expert applied one at a time."""
    import torch
    import torch.nn.functional as F

    from grouped_mm_moe import grouped_mm_moe

    g = torch.Generator().manual_seed(0)
    T, E, H, I, k = 12, 8, 32, 16, 3
    x, gu, dn = torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ids, w = torch.rand(T, E, generator=g).topk(k, -1).indices.int(), torch.rand(T, k, generator=g)
    out = grouped_mm_moe(x, gu, dn, w, ids, "gelu")
    for t in range(T):
        for j in range(k):
            h = gu[ids[t, j]] @ x[t]
            want = w[t, j] * (dn[ids[t, j]] @ (F.gelu(h[:I], approximate="tanh") * h[I:]))
            torch.testing.assert_close(out[t, j], want, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(300)
def test_serving_script_against_the_demo_server():
    import serving
    from server_utils import ServerProcess

    server = ServerProcess("--max-model-len", "128", "--enforce-eager")
    try:
        res = serving.main(["--base-url", server.url + "/v1", "--concurrency", "4", "--requests", "8",
                            "--input-len", "16", "--output-len", "6"])
    finally:
        server.terminate()
    assert res["requests"] == 8 and res["warmup_requests"] == 4 and len(res["ttft_ms"]) == 8
    assert res["ttft_ms_p99"] >= res["ttft_ms_p50"] > 0 and res["tpot_ms_p99"] >= res["tpot_ms_p50"] >= 0
    assert res["itl_ms_max"] >= res["itl_ms_p99"] > 0
    # both figures are rounded to 3 decimals, so a short run carries ~0.2% error per figure
    assert res["requests_per_s"] * res["seconds"] == pytest.approx(8, rel=0.01)
    assert res["output_tok_per_s"] == pytest.approx(res["requests_per_s"] * 6, rel=0.01)


@pytest.mark.parametrize("family,name", [("gemma", "all"), ("gemma", "moe"), ("qwen", "moe")])
def test_peer_gets_the_checkpoint_weights_back_from_merged_projections(family, name, tiny_ckpt, qwen_ckpt):
    """transformers' peer runs on our loaded weights: read back under the checkpoint's names (Gemma 4's merged
    q/k/v and gate/up split into their rows, K=V layers without v, Qwen3.5's packed experts), every tensor
    equals the checkpoint's own."""
    import throughput

    folder, hf = (tiny_ckpt if family == "gemma" else qwen_ckpt)(name)
    llm = LLM(str(folder), device="cpu", dtype="float32", enforce_eager=True, skip_tokenizer_init=True)
    expected = hf.state_dict()
    got = throughput.ours_as_checkpoint(llm.engine.executor.runner.model, expected)
    assert got.keys() == expected.keys()
    assert any("qkv" not in k and "q_proj" in k for k in got) or family == "qwen"
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def test_host_overhead_script_reports_both_engines_on_the_same_weights():
    import host_overhead

    res = host_overhead.main(["--layers", "2", "--hidden", "64", "--vocab", "512", "--batch", "2", "--prompt", "8",
                              "--new", "4", "--warmup", "0", "--runs", "1", "--enforce-eager"])
    assert res["greedy_rows_equal"] == "2/2"  # the same weights: the same greedy tokens as transformers
    assert res["ours_s"] > 0 and res["transformers_eager_s"] > 0


def test_word_tokenizer_decodes_every_id_to_text(tmp_path):
    """The serving benchmark's tokenizer for dummy checkpoints: any id the random weights sample streams as a
    non-empty piece of text, and prompts of ids round-trip."""
    from transformers import AutoTokenizer

    from configs import write_word_tokenizer

    tok = AutoTokenizer.from_pretrained(write_word_tokenizer(tmp_path, 5000))
    assert len(tok) == 5000 and tok.eos_token_id == 1
    ids = [3, 4999, 1234, 17]
    assert tok.decode(ids) == "w3 w4999 w1234 w17"
    assert all(tok.decode([i]) for i in range(3, 5000, 97))
    assert tok.encode("w5 w77", add_special_tokens=False) == [5, 77]


def dry_run_commands(folder: Path) -> list[tuple[str, dict]]:
    """The dry-run tests' subprocesses: (test name, subprocess.run's keyword arguments), each run writing under
    folder / the test's name. Listed about longest first (on a 2-core host: the sparse check ~30 s, moe_stream's
    --parts run and norm_chain's compiles ~20 s, ... pdl_chain ~5 s), the order they start in."""
    py, bench = sys.executable, ROOT / "benchmarks"
    interp = dict(os.environ, TRITON_INTERPRET="1")

    def out(test: str, file: str) -> list[str]:
        return ["--out", str(folder / f"test_{test}" / file)]

    router = [py, str(bench / "router_kernel.py"), "--smoke", "--experts", "32", "--hidden", "256", "--top-k", "4",
              "--tokens", "1,3", "--sweep"]
    moe_stream = [py, str(bench / "moe_stream.py"), "--smoke"]
    norm = "norm_chain_dry_run_compiles_both_chains_under_each_row_limit"
    runs = [
        ("sparse_gpu_check_on_the_cpu", dict(args=[py, str(ROOT / "scripts" / "check_sparse_gpu.py"), "--device", "cpu",
                                                   "--methods", "omnikv,omnikv-offload", "--out-len", "8"],
                                             timeout=600)),
        ("moe_stream_dry_run", dict(args=moe_stream + ["--parts", "--launch", "b_block_n=32,b_stages=2"]
                                    + out("moe_stream_dry_run", "parts.json"), timeout=300, env=interp)),
        (norm, dict(args=[py, str(bench / "norm_chain.py"), "--dry-run", "--hidden", "256"] + out(norm, "norm.json"),
                    timeout=600, env={k: v for k, v in os.environ.items() if k != "COMPILED_LLM_PERSISTENT_ROWS"})),
        ("router_kernel_stages_dry_run", dict(args=router + out("router_kernel_stages_dry_run", "router.json"),
                                              timeout=600, env=interp)),
        ("router_kernel_stages_dry_run", dict(args=router + ["--softmax"]
                                              + out("router_kernel_stages_dry_run", "router_softmax.json"),
                                              timeout=600, env=interp)),
        ("decode_attention_and_pdl_chain_dry_runs",
         dict(args=[py, str(bench / "decode_attention.py"), "--dry-run", "--quick", "--stream", "--ladder", "--qk"]
              + out("decode_attention_and_pdl_chain_dry_runs", "attn.json"), timeout=600)),
        ("state_kernels_dry_run", dict(args=[py, str(bench / "state_kernels.py"), "--smoke"]
                                       + out("state_kernels_dry_run", "state.json"), timeout=300, env=interp)),
        ("l2_prefetch_and_prefill_kernels_dry_runs",
         dict(args=[py, str(bench / "l2_prefetch.py"), "--dry-run"], timeout=300, env=interp)),
        ("l2_prefetch_and_prefill_kernels_dry_runs",
         dict(args=[py, str(bench / "prefill_kernels.py"), "--smoke", "--groups", "moe", "--moe-tma"]
              + out("l2_prefetch_and_prefill_kernels_dry_runs", "prefill.json"), timeout=300, env=interp)),
        ("skinny_gemm_shapes_and_dry_run", dict(args=[py, str(bench / "skinny_gemm.py"), "--device", "cpu", "--dry-run"]
                                                + out("skinny_gemm_shapes_and_dry_run", "skinny.json"), timeout=300)),
        ("moe_stream_dry_run", dict(args=moe_stream + ["--distinct", "4", "--flush-mb", "1"]
                                    + out("moe_stream_dry_run", "flush.json"), timeout=300, env=interp)),
        ("moe_stream_dry_run", dict(args=moe_stream + ["--distinct", "8", "--layers", "3"]
                                    + out("moe_stream_dry_run", "layers.json"), timeout=300, env=interp)),
        ("decode_attention_and_pdl_chain_dry_runs",
         dict(args=[py, str(bench / "pdl_chain.py"), "--dry-run"]
              + out("decode_attention_and_pdl_chain_dry_runs", "pdl.json"), timeout=300)),
    ]
    return [(f"test_{name}", kw) for name, kw in runs]


@pytest.fixture(scope="module")
def dry_runs(request, tmp_path_factory):
    """dry_runs(test name) -> (its subprocesses' results in dry_run_commands' order, its output folder). The first
    call runs those of every dry-run test this session selected from the module, side by side
    (tests/side_by_side.py: each test is a process start and a single-threaded loop or compile, the test process
    only waiting), so most of them run beside another; a run past its timeout fails its own test."""
    folder = tmp_path_factory.mktemp("dry_runs")
    selected = {getattr(item, "originalname", None) for item in request.session.items
                if getattr(item, "module", None) is request.module}
    runs = [(name, kw) for name, kw in dry_run_commands(folder) if name in selected]
    for name in {name for name, _ in runs}:
        (folder / name).mkdir()
    by_test: dict[str, list] = {}
    for (name, _), result in zip(runs, run_side_by_side(*(kw for _, kw in runs), keep_errors=True)):
        by_test.setdefault(name, []).append(result)

    def get(name: str):
        for result in by_test[name]:
            if isinstance(result, BaseException):
                raise result
        return by_test[name], folder / name

    return get


def test_skinny_gemm_shapes_and_dry_run(dry_runs):
    """benchmarks/skinny_gemm.py: the decode projection shapes match a hand count of the released configs, and
    the whole benchmark path (checks, timings, table, step totals, JSON) runs at tiny sizes on the CPU."""
    import skinny_gemm

    g = {s.name: (s.N, s.K, s.per_step) for s in skinny_gemm.gemma_shapes()}
    assert g == {"sliding qkv": ((16 + 2 * 8) * 256, 2816, 25), "sliding o_proj": (2816, 16 * 256, 25),
                 "global qkv": ((16 + 2) * 512, 2816, 5), "global o_proj": (2816, 16 * 512, 5),
                 "mlp gate_up": (2 * 2112, 2816, 30), "mlp down": (2816, 2112, 30), "lm_head": (262144, 2816, 1)}
    # the dense projections stream ~3.3 GB a step: ~0.78 ms at 4.2 TB/s
    assert sum(s.per_step * s.weight_bytes() for s in skinny_gemm.gemma_shapes() if s.name != "lm_head") == 3_290_890_240
    q = {s.name: (s.N, s.K, s.per_step) for s in skinny_gemm.qwen_shapes()}
    assert q["linear in_proj_qkv"] == (2 * 16 * 128 + 32 * 128, 2048, 0)
    assert q["linear in_proj [qkv;z;b;a] merged"] == (8192 + 4096 + 32 + 32, 2048, 30)  # the model's one GEMM
    assert q["full qkv (q+gate)"] == (16 * 2 * 256 + 2 * 2 * 256, 2048, 10)
    assert q["shared_expert down"] == (2048, 512, 40) and q["lm_head"] == (248320, 2048, 1)
    (r,), out = dry_runs("test_skinny_gemm_shapes_and_dry_run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((out / "skinny.json").read_text())["rows"]
    assert rows and all(r["default_us"] and r["best_us"] and not r["skipped"] for r in rows)


@pytest.mark.parametrize("device,run_file", [
    ("NVIDIA H200", "skinny_gemm_merge_call2_20261203_s28.json"),
    ("NVIDIA H100 80GB HBM3", "skinny_gemm_wide_h100_20261206_s53.json"),
])
def test_the_measured_wide_table_is_what_the_gpus_run_gives(device, run_file):
    """ops/linear.py's WIDE_MEASURED for each GPU model is skinny_gemm.py's table from that GPU's recorded run (the
    unsplit launch at least 3% faster than cuBLAS at 1, 4 and 8 rows: H200 session 28, H100 session 53), and the
    rule leaves a shape out when one row count misses the margin."""
    import skinny_gemm

    from compiled_llm.ops.linear import WIDE_MEASURED

    run = json.loads((ROOT / "benchmarks/results" / run_file).read_text())
    assert run["device"] == device
    assert skinny_gemm.wide_table(run["rows"]) == sorted(WIDE_MEASURED[device])
    lm = [r for r in run["rows"] if r["name"] == "lm_head" and r["model"].startswith("gemma")]
    assert len(lm) == 3 and skinny_gemm.wide_table(lm) == [(262144, 2816)]
    slow = [dict(r, cublas_us=r["cublas_us"] * (0.95 if r["M"] == 4 else 1.0)) for r in lm]
    assert skinny_gemm.wide_table(slow) == []  # cuBLAS within the margin at one row count


def test_the_narrow_decode_launches_are_what_the_h200_run_measured_fastest():
    """skinny_gemm.DECODE_LAUNCH comes from the recorded H200 run of skinny_gemm.py --try (session 33, 1, 4 and 8
    rows): on every narrow weight the op takes in a decode step (N < K, at least 2M elements: not Qwen3.5's
    one-column shared-expert gate), it is within 1% of the fastest launch tried and faster than session 28's launch
    (the run's engine column) and cuBLAS."""
    import dataclasses

    from compiled_llm.ops import linear
    from compiled_llm.ops.triton import skinny_gemm as S

    run = json.loads((ROOT / "benchmarks/results/skinny_gemm_try_call3_20261204_s33.json").read_text())
    assert run["device"] == "NVIDIA H200"
    narrow = [r for r in run["rows"] if r["N"] < r["K"] and r["per_step"] and linear.takes(r["N"], r["K"])]
    assert {r["name"] for r in narrow} == {"sliding o_proj", "global o_proj", "linear out_proj", "full o_proj",
                                           "shared_expert gate_up"}
    assert not linear.takes(1, 2048)
    for r in narrow:
        times = {tuple(sorted(lr["launch"].items())): lr["us"] for lr in r["launches"] if lr.get("us")}
        t = times[tuple(sorted(dataclasses.asdict(S.decode_launch(r["N"], r["K"])).items()))]
        assert t <= 1.01 * min(times.values()), (r["name"], r["M"], t, min(times.values()))
        assert t < r["engine_us"] and t < r["cublas_us"], (r["name"], r["M"])


def test_decode_attention_and_pdl_chain_dry_runs(dry_runs):
    """benchmarks/decode_attention.py and pdl_chain.py run their whole path on the CPU (Triton interpreter,
    tiny shapes): every candidate agrees with the engine's launch (--ladder's top level too), the global layer's full key rebuild and
    the partial one agree, --stream's kernel sums exactly the rows the engine's launch reads (checked inside, with
    and without the block table), --qk's two forms of the decode with its QK-norm inside give equal outputs, and the
    chain's Triton GEMMs equal cuBLAS's (float32)."""
    (r, r_pdl), out = dry_runs("test_decode_attention_and_pdl_chain_dry_runs")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((out / "attn.json").read_text())["rows"]
    checked = [row for row in rows if "max_diff" in row]
    assert len(checked) >= 12 and all(row["max_diff"] < 1e-4 for row in checked), checked
    assert {row["candidate"] for row in rows if row["layer"] == "global"} >= {
        "engine", "every key rebuilt (session 12)", "no-rebuild (K!=V path, same bytes)"}
    # --ladder: the kernel rebuilt in five levels (the sliding layer's and the global layer's over its kept keys),
    # the top one merged equal to the engine's output
    ladder = [row for row in rows if row["candidate"].startswith("ladder")]
    assert [row["candidate"][:8] for row in ladder] == [f"ladder {i}" for i in range(5)] * 4
    assert {row["layer"] for row in ladder} == {"sliding", "global"}
    assert all(row["max_diff"] < 1e-4 for row in ladder if row["candidate"].startswith("ladder 4"))
    qk = [row for row in rows if row["candidate"].startswith("qk")]  # the sliding layer's two cases, three rows each
    assert len(qk) == 6 and {row["layer"] for row in qk} == {"sliding"}
    assert all(row["max_diff"] == 0 for row in qk if "in-register" in row["candidate"])
    streams = [row for row in rows if row["candidate"].startswith("stream")]
    assert len(streams) == 2 * 2 * 2  # both layers, both cases, with and without the block table
    r = r_pdl
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((out / "pdl.json").read_text())["rows"]
    assert [(row["tokens"], row["variant"]) for row in rows] == [
        (m, v) for m in (1, 8) for v in ("cublas", "triton", "triton@32x128w4")]  # a swept tile too
    assert all(row["max_diff_vs_cublas"] < 1e-4 for row in rows)


def test_norm_chain_dry_run_compiles_both_chains_under_each_row_limit(dry_runs):
    """benchmarks/norm_chain.py on the CPU: both of a Gemma 4 MoE layer's norm chains (the feedforward one summing
    the 8 routed picks) compiled with the token count dynamic under each persistent-row limit and first-run size,
    each equal to the eager chain at every row count."""
    (r,), out = dry_runs("test_norm_chain_dry_run_compiles_both_chains_under_each_row_limit")  # (without
    # COMPILED_LLM_PERSISTENT_ROWS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((out / "norm.json").read_text())["rows"]
    variants = {(8192, 5), (0, 5), (0, 8192)}
    for chain in ("attn", "ffn"):
        got = {(row["persistent_rows"], row["first_run"], row["rows"]) for row in rows if row["chain"] == chain}
        assert got == {v + (n,) for v in variants for n in (1, 8)}, got
    assert all(row["max_err"] < 1e-3 and row["us"] is None for row in rows)


def test_l2_prefetch_and_prefill_kernels_dry_runs(dry_runs):
    """benchmarks/l2_prefetch.py's decode-layer chain and prefill_kernels.py's MoE sweep with and without TMA
    (MoELaunch.tma) run their CPU paths under the Triton interpreter; every MoE candidate agrees with the policy's."""
    (r, r_prefill), out = dry_runs("test_l2_prefetch_and_prefill_kernels_dry_runs")
    assert r.returncode == 0 and "dry run: chain ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    r = r_prefill
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((out / "prefill.json").read_text())["rows"]
    assert rows[0]["default"] and {row["cand"]["tma"] for row in rows} == {True, False}
    assert all(row["ok"] for row in rows), rows


def test_power_cap_reports_the_rate_window_by_window():
    """benchmarks/power_cap.py's sustained loop on the CPU: consecutive windows of at least the window's length
    cover the requested time, each with the products' rate."""
    from power_cap import sustained_rate

    rows = sustained_rate("cpu", 64, 0.3, window=0.05)
    ts = [r["t"] for r in rows]
    assert len(rows) >= 4 and ts == sorted(ts) and ts[-1] >= 0.3
    assert all(b - a >= 0.05 - 1e-9 for a, b in zip([0.0] + ts, ts))  # (t - t0) - (t' - t0): float rounding
    assert all(r["flops"] > 0 for r in rows)


def test_state_kernels_dry_run(dry_runs):
    """benchmarks/state_kernels.py (Qwen3.5's conv and delta-rule decode tiles, the two in one launch, the MoE
    top-k sum's) runs its
    whole path on the CPU under the Triton interpreter: the first row of each group is the engine's launch, and
    every other tile computes the same outputs and new state (the conv and the sum bitwise)."""
    from compiled_llm.ops.triton.conv1d import conv_tiles

    (r,), out = dry_runs("test_state_kernels_dry_run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((out / "state.json").read_text())["rows"]
    for group in ("conv", "gdr_recurrent", "conv_gdr", "conv_gdr_tiles", "topk_sum H=96"):
        mine = [row for row in rows if row["group"] == group]
        assert len(mine) >= 2 and mine[0]["default"] and all(row["ok"] for row in mine), mine
    assert tuple(next(row for row in rows if row["group"] == "conv")["cand"]) == conv_tiles(True)
    # the conv inside the recurrent launch: bitwise the two launches' outputs, windows and states
    assert [row["cand"] for row in rows if row["group"] == "conv_gdr"] == ["split", "fused"]
    assert all(row["max_diff"] == 0.0 for row in rows if row["group"] in ("conv", "conv_gdr", "topk_sum H=96"))


def test_sparse_gpu_check_on_the_cpu(dry_runs):
    """scripts/check_sparse_gpu.py (issue 19's token check for the GPU) runs its whole path on the CPU: OmniKV
    compiled against eager, tokens equal (no CUDA graphs here, so no whole-graph steps are asked for), and
    compiled with the sparse layers' KV offloaded against eager with all of it on the device."""
    (r,), _ = dry_runs("test_sparse_gpu_check_on_the_cpu")
    assert r.returncode == 0 and "SPARSE GPU CHECK PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("tokens 4/4 equal") == 2


def test_moe_stream_dry_run(dry_runs):
    """benchmarks/moe_stream.py (the decode MoE's time against the experts it touches, and a kernel that only
    streams the same gate/up tiles) runs its whole path on the CPU under the Triton interpreter: the stream
    kernel's sums equal the touched weights' own (checked inside), each call's picks cover exactly the asked
    number of experts with no expert twice in a token, and the fit spans every point (with --parts, the gate/up and
    down kernels each alone, whose output is checked equal to the whole routed op's; with --launch, the routed op
    at another tile, checked close to the policy's)."""
    pytest.importorskip("triton")
    (r, r_flush, r_layers), out = dry_runs("test_moe_stream_dry_run")  # --parts --launch; --flush-mb; --layers
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "parts.json").read_text())
    assert [row["distinct"] for row in data["rows"]] == [4, 8, 12, 16]
    names = ("moe", "gate_up", "down", "gate_up_aligned", "stream", "stream_dot", "copy",  # --parts: each alone
             "moe[b_block_n=32,b_stages=2]", "gate_up[b_block_n=32,b_stages=2]",  # --launch: another tile
             "down[b_block_n=32,b_stages=2]")
    assert all(row[f"{v}_us"] > 0 for row in data["rows"] for v in names)
    assert set(data["fit"]) == set(names)
    # --flush-mb: a read of that size before each timed call, its own time taken off (on the CPU a wall-clock
    # difference, any sign)
    r = r_flush
    assert r.returncode == 0 and "L2 flush: 1 MB read before each call" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((out / "flush.json").read_text())["flush_mb"] == 1
    # --layers: each op over that many copies of the weights in turn, beside the same op on one copy
    r = r_layers
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    row = json.loads((out / "layers.json").read_text())["row"]
    assert row["distinct"] == 8 and row["layers"] == 3
    assert set(row) - {"distinct", "layers"} == {"moe", "gate_up", "down", "stream_dot", "copy"}
    assert all(v["one_layer_us"] > 0 and v["layers_us"] > 0 for k, v in row.items() if isinstance(v, dict))
    from moe_stream import picks

    for d in (8, 20, 64):
        ids = picks(8, 8, 128, d, "cpu")
        assert ids.unique().numel() == d and all(row.unique().numel() == 8 for row in ids)


def test_router_kernel_stages_dry_run(dry_runs):
    """benchmarks/router_kernel.py --parts (here --smoke: the CPU under the Triton interpreter) times the fused
    router's stages as builds of their own (RouterLaunch.parts) and, with --sweep, other tiles: the full build
    picks what the default does (bitwise), the other tiles the same experts, and every launch leaves its ticket
    counters at zero; both router forms (Gemma 4's normed, Qwen3.5's softmax)."""
    pytest.importorskip("triton")
    runs, folder = dry_runs("test_router_kernel_stages_dry_run")
    forms, outs = ([], ["--softmax"]), (folder / "router.json", folder / "router_softmax.json")
    for form, out, r in zip(forms, outs, runs):
        assert r.returncode == 0 and "all checks passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
        rows = json.loads(out.read_text())["rows"]
        for t in (1, 3):
            stages = [row["parts"] for row in rows if row["tokens"] == t and "{" not in row["stage"]]
            assert stages == [0, 1, 2, 3]
        full = [row for row in rows if row.get("parts") == 3]
        # the default and 24 tiles at each batch; at 3 tokens also the token blocks under the default's (two launches
        # each): 1 and 2 rows below the normed router's 8, 1 row below the softmax router's 2 (softmax_block_t)
        blocks = 2 if form else 4
        assert len(full) == 2 * (1 + 24) + blocks and all(row["ok"] and row["tickets_clean"] for row in full)
        assert sum("'block_t': 1" in row["stage"] for row in full) == 2
        assert all(row["w_maxdiff_default"] == 0.0 for row in full if "{" not in row["stage"])


def test_moe_routing_counts_the_experts_of_each_decode_step(tmp_path):
    """benchmarks/moe_routing.py on a shrunken Qwen3.5 preset with dummy weights: one count a MoE layer a decode
    step, each between k and min(E, batch x k), beside the floor's expectation; the wrapper counts what the
    router returned and is undone afterwards."""
    import moe_routing

    from compiled_llm.models import qwen3_5

    cfg = dict(config_dict("qwen3.5-35b-a3b"), num_hidden_layers=4, layer_types=qwen_layer_types(4), hidden_size=64,
               vocab_size=512, num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    folder = write_config_folder(cfg, tmp_path / "qwen3.5-small")
    router = qwen3_5.ref_softmax_router_topk
    res = moe_routing.main(["--model", str(folder), "--device", "cpu", "--dtype", "float32", "--shape", "6x3x5",
                            "--out", str(tmp_path / "routing.json")])
    assert qwen3_5.ref_softmax_router_topk is router  # unwrapped again
    assert res["decode_steps"] == 4 and len(res["per_layer_mean"]) == 4  # 5 new tokens: the first from prefill
    assert 2 <= res["min"] <= res["max"] <= 6
    assert res["expected"] == pytest.approx(8 * (1 - (1 - 2 / 8) ** 3), abs=0.01)
    assert res["mean_over_expected"] == pytest.approx(res["mean"] / res["expected"], abs=0.01)
    assert json.loads((tmp_path / "routing.json").read_text())["per_layer_mean"] == res["per_layer_mean"]

    torch.manual_seed(0)
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with moe_routing.RouteCounter(3) as counter:
        _, ids = qwen3_5.ref_softmax_router_topk(x, w, 2)
        qwen3_5.ref_softmax_router_topk(x[:2], w, 2)  # not a 3-row call: not counted
    assert counter.counts == [len(set(ids.flatten().tolist()))]


def test_compiler_gpu_check_structured_section_on_the_cpu():
    """scripts/compiler_gpu_check.py's structured-output section (run compiled on the H200 with --jit-monitor
    error), here eager on the CPU: constrained rows beside free ones, all constrained, one alone, 17 by index."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import compiler_gpu_check

    pytest.importorskip("xgrammar")
    assert compiler_gpu_check.structured("cpu", eager=True)
    assert compiler_gpu_check.RESULTS["structured"]["ok"]
