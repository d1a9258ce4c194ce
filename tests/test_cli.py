"""`python -m compiled_llm generate`: output, help, one-line errors."""

import json
import subprocess
import sys
from dataclasses import fields

from compiled_llm import LLM, SamplingParams
from compiled_llm.cli import main
from compiled_llm.config import EngineConfig


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "compiled_llm", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_prints_what_the_api_gives(tiny_ckpt):
    folder, _ = tiny_ckpt("dense")
    res = run("generate", "--model", str(folder), "--temperature", "0", "--max-tokens", "8", "--ignore-eos",
              "--enforce-eager", "--json", "Once upon a time", "The quick")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    llm = LLM(str(folder), enforce_eager=True)
    ref = llm.generate(["Once upon a time", "The quick"], SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True))
    assert [r["token_ids"] for r in rows] == [o.outputs[0].token_ids for o in ref]
    assert [r["text"] for r in rows] == [o.outputs[0].text for o in ref]


def test_help_documents_every_engine_flag():
    res = run("generate", "--help")
    assert res.returncode == 0
    for f in fields(EngineConfig):
        if f.name != "extra":
            assert "--" + f.name.replace("_", "-") in res.stdout, f.name


def test_help_shows_each_default_once():
    """Flags whose help states its default got a second "(default: ...)" from the formatter (issue 20)."""
    import re

    from compiled_llm.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and "serve" in a.choices).choices
    for name in ("generate", "serve", "compile-cache"):
        text = " ".join(sub[name].format_help().split())  # one line: wrapped helps are joined
        assert not re.search(r"\(default: [^)]*\)\s*\(default:", text), name
        assert "--max-num-seqs MAX_NUM_SEQS most sequences in one step (default: 64) " in text, name
    assert "--top-k TOP_K sample from the k most likely tokens; 0 is off (default: 0)" in " ".join(
        sub["generate"].format_help().split())


def test_bad_input_is_a_one_line_error(tiny_ckpt, tmp_path, capsys):
    """main() in this process: the exit status `python -m compiled_llm` exits with (__main__.py; the command
    itself runs in test_generate_prints_what_the_api_gives) and the last line it wrote to stderr."""
    folder, _ = tiny_ckpt("dense")

    def run_main(*args) -> tuple[int, str]:
        code = main(list(args))
        return code, capsys.readouterr().err.strip().splitlines()[-1]

    code, last = run_main("generate", "--model", str(folder), "--temperature", "-1", "hi")
    assert code == 2 and last.startswith("error: temperature")
    code, last = run_main("generate", "--model", str(tmp_path / "nope"), "hi")
    assert code == 2 and "does not exist" in last
    code, last = run_main("generate", "--model", str(folder), "--device", "cpu", "--tp-allreduce", "symm-mem", "hi")
    assert code == 2 and "symm-mem needs CUDA" in last, last
