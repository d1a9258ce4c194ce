"""The compile cache: a folder holding everything start-up compiles (Inductor's FX-graph and AOT caches
with their generated kernels, Triton builds, FlashInfer JIT builds) plus a manifest.

    DIR/manifest.json   key, the parts it hashes, every file's sha256, the compile report
    DIR/inductor/       TORCHINDUCTOR_CACHE_DIR while compiling
    DIR/triton/         TRITON_CACHE_DIR
    DIR/flashinfer/     FLASHINFER_WORKSPACE_BASE

The key hashes the model config, the engine flags that shape compilation, the torch / triton /
flashinfer / python versions, the device, and the source of our ops, passes, compiler and models (all
of it, not only what tracing saw: editing a kernel invalidates what used it). A stale key or a file
whose hash differs is reported in a warning and the cache is rebuilt, never used silently.

The manifest names files relative to DIR and Inductor's and Triton's entries are keyed by content, so DIR
can be moved or copied to a machine with the same versions. Triton's group files do name absolute paths
(of the temporary build folder); while the cache is in use Triton reads them through
compiler/triton_cache.py, which finds each file by name beside its group file. (Inductor before torch 2.14 put
each graph's repro script, with the build folder's path, into its compiled code: no longer written,
compiler/codegen.py without_repro_script.) A build goes
to a sibling temporary folder and is renamed into place under a lock, so concurrent builders leave one
valid cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger("compiled_llm")

FORMAT = 1
ENV = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR", "flashinfer": "FLASHINFER_WORKSPACE_BASE"}
PACKAGE = Path(__file__).resolve().parent.parent


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_hash() -> str:
    """Our code that compiled artefacts depend on (relative paths, so the hash does not move)."""
    h = hashlib.sha256()
    for folder in ("ops", "passes", "compiler", "models"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            h.update(str(path.relative_to(PACKAGE)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for pkg in ("triton", "flashinfer"):
        try:
            out[pkg] = __import__(pkg).__version__
        except Exception:  # not installed (or broken): part of the key either way
            out[pkg] = None
    return out


def device_id(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "capability": list(torch.cuda.get_device_capability(device)),
                "cuda": torch.version.cuda}
    return {"type": device.type, "machine": platform.machine(), "processor": platform.processor()}


def cache_key(model_config: dict, flags: dict, device: torch.device) -> tuple[str, dict]:
    parts = {"format": FORMAT, "model_config": model_config, "flags": flags, "versions": versions(),
             "device": device_id(device), "source": source_hash()}
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest(), parts


def _listing(root: Path) -> dict[str, str]:
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != "manifest.json" and not path.name.endswith(".lock"):
            files[str(path.relative_to(root))] = _sha256_file(path)
    return files


def _diff_parts(old: dict, new: dict) -> str:
    new = json.loads(json.dumps(new, sort_keys=True, default=str))  # as the manifest holds it (lists, strings)
    changed = [k for k in new if old.get(k) != new.get(k)]
    return ", ".join(changed) or "key"


class CompileCache:
    def __init__(self, folder: str | os.PathLike, model_config: dict, flags: dict, device: torch.device):
        self.dir = Path(folder).expanduser().absolute()
        self.key, self.parts = cache_key(model_config, flags, device)
        self.status = "unchecked"  # hit | built | rebuilt
        self.problem: str | None = None
        self.report: dict | None = None
        self.root: Path | None = None  # the folder in use during a session (DIR on a hit, a build folder otherwise)

    # ---- checking ------------------------------------------------------------------------------
    def check(self) -> str | None:
        """None when DIR holds a valid cache for this key, else why not."""
        manifest = self.dir / "manifest.json"
        if not self.dir.exists():
            return "missing"
        try:
            data = json.loads(manifest.read_text())
        except FileNotFoundError:
            return "corrupt: no manifest.json"
        except (OSError, ValueError) as e:
            return f"corrupt: unreadable manifest ({e})"
        if not isinstance(data, dict) or data.get("format") != FORMAT or "files" not in data:
            return "corrupt: manifest of an unknown format"
        if data.get("key") != self.key:
            return f"stale: built for a different {_diff_parts(data.get('parts', {}), self.parts)}"
        for rel, digest in data["files"].items():
            path = self.dir / rel
            if not path.is_file():
                return f"corrupt: {rel} is missing"
            if _sha256_file(path) != digest:
                return f"corrupt: {rel} does not match its hash"
        self.report = data.get("report")
        return None

    # ---- using -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _pointed_at(self, root: Path):
        """Inductor, Triton and FlashInfer read and write their caches under root."""
        saved = {var: os.environ.get(var) for var in (*ENV.values(), "TRITON_CACHE_MANAGER")}
        for sub, var in ENV.items():
            (root / sub).mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(root / sub)
        manager = triton_manager()
        if manager is not None:
            os.environ["TRITON_CACHE_MANAGER"] = manager
        try:
            yield
        finally:
            for var, old in saved.items():
                if old is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = old

    @contextlib.contextmanager
    def session(self, summary=lambda: None):
        """Wraps start-up compilation: uses DIR when valid, else builds a fresh cache and installs it."""
        why = self.check()
        if why is None:
            self.status = "hit"
            log.info("compile cache %s: hit", self.dir)
            self.root = self.dir
            with self._pointed_at(self.dir):
                yield self
            return
        if why != "missing":
            log.warning("compile cache %s is %s; rebuilding it", self.dir, why)
            self.problem = why
        self.status = "rebuilt" if why != "missing" else "built"
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.dir.name}.build-", dir=self.dir.parent))
        self.root = tmp
        try:
            with self._pointed_at(tmp):
                yield self
            self.report = summary()
            self._write_manifest(tmp)
            self._install(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _strip_paths(root: Path) -> None:
        """Shared objects name their source file (the build folder's absolute path) in the symbol table;
        strip it so the cache holds no absolute path. Loading never reads it."""
        strip = shutil.which("strip")
        if strip is None:
            return
        for so in root.rglob("*.so"):
            out = so.with_name(so.name + ".stripped")
            # into a new file, then renamed over: this process has the old one mapped
            if subprocess.run([strip, "--strip-unneeded", "-o", str(out), str(so)], capture_output=True).returncode == 0:
                os.replace(out, so)
            else:
                out.unlink(missing_ok=True)

    def _write_manifest(self, root: Path) -> None:
        self._strip_paths(root)
        data = {"format": FORMAT, "key": self.key, "parts": self.parts, "created": time.time(),
                "files": _listing(root), "report": self.report}
        (root / "manifest.json").write_text(json.dumps(data, indent=1, sort_keys=True, default=str))

    def _install(self, tmp: Path) -> None:
        """Atomic rename into place; under a lock so a concurrent builder either wins or keeps what won."""
        lock_path = self.dir.parent / f".{self.dir.name}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.check() is None:
                log.info("compile cache %s: another process installed it first; keeping theirs", self.dir)
                return
            old = None
            if self.dir.exists():
                old = self.dir.parent / f".{self.dir.name}.old-{os.getpid()}-{time.time_ns()}"
                os.rename(self.dir, old)
            os.rename(tmp, self.dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        log.info("compile cache %s: written (%d files)", self.dir, len(_listing(self.dir)))


def triton_manager() -> str | None:
    """TRITON_CACHE_MANAGER's value for a relocatable Triton cache (None without triton)."""
    try:
        from compiled_llm.compiler.triton_cache import SPEC
    except ImportError:
        return None
    return SPEC


def compile_counters() -> dict:
    """What was compiled in this process so far (Inductor FX graphs, AOT graphs, C++ and Triton builds)."""
    from torch._dynamo.utils import counters

    from compiled_llm.ops.jit import MONITOR

    return {
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_bypass": counters["inductor"]["fxgraph_cache_bypass"],  # compiled, and not cacheable
        "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_cache_bypass": counters["aot_autograd"]["autograd_cache_bypass"],
        "triton_jit": MONITOR.compiles["triton"],  # our Triton kernels built or loaded from TRITON_CACHE_DIR
        "triton_builds": sum(MONITOR.triton_builds.values()),  # Triton's cache missed (ours and Inductor's)
        "triton_cache_hits": sum(MONITOR.triton_cache_hits.values()),
        "cpp_builds": CPP_BUILDS[0],
    }


CPP_BUILDS = [0]


def count_cpp_builds() -> None:
    """Counts C++ builds (the CPU kernels Inductor generates) by wrapping the builder once per process."""
    try:
        from torch._inductor.cpp_builder import CppBuilder
    except ImportError:
        return
    if getattr(CppBuilder.build, "_counted", False):
        return
    original = CppBuilder.build

    def build(self, *args, **kwargs):
        if not str(self.get_target_file_path()).endswith(".i"):  # not the header preprocessing each process does
            CPP_BUILDS[0] += 1
        return original(self, *args, **kwargs)

    build._counted = True
    CppBuilder.build = build

