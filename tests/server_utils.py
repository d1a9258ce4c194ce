"""Helpers for the server tests: a server subprocess, a /metrics parser, and a fake engine."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from compiled_llm.config import EngineConfig
from compiled_llm.outputs import CompletionOutput, Logprob, RequestOutput

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command() -> list[str]:
    """`python -m compiled_llm serve` once the top-level CLI exists, else `python -m compiled_llm.server`."""
    if (ROOT / "compiled_llm" / "__main__.py").exists() and (ROOT / "compiled_llm" / "cli.py").exists():
        return [sys.executable, "-m", "compiled_llm", "serve"]
    return [sys.executable, "-m", "compiled_llm.server"]


class ServerProcess:
    """The real server in a subprocess on a free loopback port."""

    def __init__(self, *args: str, startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="server-", suffix=".log", delete=False)
        cmd = server_command() + ["--host", "127.0.0.1", "--port", str(self.port), *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("COMPILED_LLM_API_KEY", None)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server did not become healthy:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} and {'name': value} summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad metrics line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name + labels] = value
        out[name] = out.get(name, 0.0) + value
    return out


def metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Value of one sample, matched by name and the given labels."""
    for key, value in metrics.items():
        if key.startswith(name + "{") and all(f'{k}="{v}"' in key for k, v in labels.items()):
            if "_bucket" in name or 'le="' not in key:
                return value
    raise KeyError(f"{name} {labels}")


# ------------------------------------------------------------------ fake engine
class FakeTokenizer:
    """One token per character: id = ord(c) + 3 (0 pad, 1 bos, 2 eos)."""

    bos_token_id, eos_token_id = 1, 2

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [min(ord(c), 255) + 3 for c in text]
        return ([1] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - 3) for i in ids if i >= 3)

    def convert_ids_to_tokens(self, ids):
        return [chr(i - 3) if i >= 3 else f"<{i}>" for i in ids]


class FakeInputProcessor:
    """The server's side of admission (LLMEngine.new_input_processor()): a text-only model, a plain template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, chat_template=None, tools=None,
                            template_kwargs=None):
        if set(template_kwargs or {}) & {"tools", "messages", "add_generation_prompt"}:
            raise ValueError("chat_template_kwargs may not set them")
        if chat_template:  # a real Jinja template, rendered as transformers does
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(chat_template).render(messages=messages, tools=tools, bos_token="",
                                                         add_generation_prompt=add_generation_prompt,
                                                         **(template_kwargs or {}))
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def media_placeholders(self) -> dict[str, str]:
        return {}

    def process_media_prompt(self, prompt: dict):
        raise ValueError("this model takes no media")


class FakeEngine:
    """The engine contract with a trivial model: sample j of a prompt cycles through letters.

    Each step produces one token for every running sample and records the batch size; a prompt
    containing CRASH makes step() raise; a prompt containing SLOW makes each step take 50 ms.
    `scripts`: texts the next requests answer with instead (one character per step, then EOS: "stop"), so that
    tests can make "the model" write a given answer (a tool call). Every request's prompt text and params are
    kept in `prompts` and `params`.
    """

    def __init__(self, max_model_len: int = 256, step_delay: float = 0.002):
        self.scripts: list[str] = []
        self.priorities: list[int] = []  # each request's scheduling priority
        self.prompts: list[str] = []
        self.params: list = []
        self.config = EngineConfig(max_model_len=max_model_len)
        self.model_name = "fake-model"
        self.tokenizer = FakeTokenizer()
        self.step_delay = step_delay
        self.requests: dict[str, dict] = {}
        self.batch_sizes: list[int] = []
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.prepared: list[tuple[dict, int]] = []  # (structured_output spec, the thread that compiled it)

    def prepare_structured_output(self, spec):
        self.prepared.append((spec, threading.get_ident()))

    def _touch(self):
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0):
        self._touch()
        self.priorities.append(priority)
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or (isinstance(prompt, str) and not prompt):
            raise ValueError("the prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.config.max_model_len}")
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        self.prompts.append(text)
        self.params.append(params)
        limit = self.config.max_model_len - len(ids)
        max_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        seqs = [{"index": i, "ids": [], "lps": [], "text": "", "finish": None, "stop": None} for i in range(params.n)]
        self.requests[request_id] = {"ids": ids, "params": params, "seqs": seqs, "max": max_tokens,
                                     "crash": "CRASH" in text, "slow": "SLOW" in text,
                                     "script": self.scripts.pop(0) if self.scripts else None}

    def abort_request(self, request_id):
        self._touch()
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self._touch()
        if any(r["crash"] for r in self.requests.values()):
            raise RuntimeError("simulated engine failure")
        time.sleep(0.05 if any(r["slow"] for r in self.requests.values()) else self.step_delay)
        running = sum(1 for r in self.requests.values() for s in r["seqs"] if s["finish"] is None)
        self.batch_sizes.append(running)
        outputs = []
        for rid, r in list(self.requests.items()):
            p = r["params"]
            for s in r["seqs"]:
                if s["finish"] is not None:
                    continue
                k = len(s["ids"])
                if r["script"] is not None and k == len(r["script"]):
                    s["finish"] = "stop"  # EOS: not part of the text
                    continue
                tok = 3 + ord("a") + (sum(r["ids"]) + k + s["index"]) % 26
                if r["script"] is not None:
                    tok = self.tokenizer.encode(r["script"][k], add_special_tokens=False)[0]
                s["ids"].append(tok)
                if p.logprobs is not None:
                    entry = {tok: Logprob(-0.5, 1, chr(tok - 3))}
                    for j in range(p.logprobs):
                        entry.setdefault(3 + ord("a") + j, Logprob(-1.0 - j, j + 1, chr(ord("a") + j)))
                    s["lps"].append(entry)
                s["text"] += chr(tok - 3)
                for stop in p.stop:
                    i = s["text"].find(stop)
                    if i >= 0:
                        s["text"] = s["text"][: i + len(stop) if p.include_stop_str_in_output else i]
                        s["finish"], s["stop"] = "stop", stop
                        break
                if s["finish"] is None and len(s["ids"]) >= r["max"]:
                    s["finish"] = "length"
            done = all(s["finish"] for s in r["seqs"])
            outs = [CompletionOutput(s["index"], s["text"], s["ids"], None,
                                     s["lps"] if p.logprobs is not None else None, s["finish"], s["stop"])
                    for s in r["seqs"]]
            outputs.append(RequestOutput(rid, None, r["ids"], outs, done))
            if done:
                del self.requests[rid]
        return outputs

    def get_stats(self):
        running = sum(1 for r in self.requests.values() for s in r["seqs"] if s["finish"] is None)
        return {"num_running": running, "num_waiting": 0, "kv_cache_usage": min(1.0, running / 100),
                "num_free_blocks": 100 - running, "num_total_blocks": 100, "prefix_cache_queries": 10,
                "prefix_cache_hits": 5, "num_preemptions": 0}

    def is_healthy(self):
        return True

    def new_input_processor(self):
        return FakeInputProcessor(FakeTokenizer())


class FakeServers:
    """Apps on fake engines, each with the official OpenAI client on a TestClient (no socket); `close()` ends
    them. `make(**create_app_kwargs)` -> (engine, client); the engine's `scripts` say what "the model" writes."""

    def __init__(self):
        self._clients = []

    def make(self, **app_kw):
        import openai
        from fastapi.testclient import TestClient

        from compiled_llm.server.app import create_app

        engine = FakeEngine(max_model_len=4096, step_delay=0)
        client = TestClient(create_app(engine, **app_kw))
        client.__enter__()
        self._clients.append(client)
        return engine, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)

    def close(self) -> None:
        for c in self._clients:
            c.__exit__(None, None, None)
