"""Server metrics in the Prometheus text exposition format (no client library needed)."""

from __future__ import annotations

import bisect
import math
import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
# a finished request's phases (vLLM's request_*_time_seconds): waiting, first scheduled to first token (prefill),
# first to last token (decode), first scheduled to last token (inference)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0,
                 300.0, 600.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
PHASES = {
    "queue": "Time a finished request waited before it was first scheduled.",
    "prefill": "Time from a finished request's first scheduling to its first generated token (its prefill).",
    "decode": "Time from a finished request's first generated token to its last.",
    "inference": "Time from a finished request's first scheduling to its last token (prefill and decode).",
}
STATUSES = ("stop", "length", "abort", "error")
PREFIX = "compiled_llm_"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    """Counters and histograms, updated from the engine thread and the event loop (hence the lock)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(STATUSES, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.phases = {name: Histogram(PHASE_BUCKETS) for name in PHASES}
        self.request_prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_BUCKETS)

    # --- recording -------------------------------------------------------
    def count_status(self, status: str, amount: int = 1) -> None:
        with self._lock:
            self.requests[status] = self.requests.get(status, 0) + amount

    def add_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        with self._lock:
            self.tpot.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        with self._lock:
            self.e2e.observe(seconds)

    def observe_finished(self, metrics, prompt_tokens: int, generated: int) -> None:
        """A finished request: its phases from the engine's timestamps (RequestMetrics; a phase it did not reach,
        such as the decode of a request aborted before its first token, is left out) and its token counts."""
        marks = (metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time)
        arrival, scheduled, first, last = marks
        spans = {"queue": (arrival, scheduled), "prefill": (scheduled, first), "decode": (first, last),
                 "inference": (scheduled, last)}
        with self._lock:
            for name, (start, end) in spans.items():
                if start is not None and end is not None:
                    self.phases[name].observe(max(0.0, end - start))
            self.request_prompt_tokens.observe(prompt_tokens)
            self.request_generation_tokens.observe(generated)

    # --- exposition --------------------------------------------------------
    def render(self, stats: dict, healthy: bool) -> str:
        out: list[str] = []
        model = f'model_name="{_escape(self.model_name)}"'

        def family(name: str, kind: str, help_: str) -> str:
            full = PREFIX + name
            out.append(f"# HELP {full} {help_}")
            out.append(f"# TYPE {full} {kind}")
            return full

        def sample(name: str, value: float, labels: str = "") -> None:
            lab = model + ("," + labels if labels else "")
            out.append(f"{name}{{{lab}}} {_fmt(value)}")

        def histogram(name: str, help_: str, h: Histogram) -> None:
            full = family(name, "histogram", help_)
            cumulative = 0
            for bound, count in zip(h.buckets + (math.inf,), h.counts):
                cumulative += count
                sample(full + "_bucket", cumulative, f'le="{_fmt(bound)}"')
            sample(full + "_sum", h.sum)
            sample(full + "_count", h.count)

        def stat(key: str, default=0):
            value = stats.get(key, default)
            return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default

        with self._lock:
            name = family("requests_total", "counter",
                          "Finished sequences by finish reason (stop, length, abort) and rejected requests (error).")
            for status, count in self.requests.items():
                sample(name, count, f'status="{_escape(status)}"')
            sample(family("prompt_tokens_total", "counter", "Prompt tokens of admitted requests."),
                   self.prompt_tokens)
            sample(family("generation_tokens_total", "counter", "Generated tokens."), self.generation_tokens)
            histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.", self.ttft)
            histogram("time_per_output_token_seconds",
                      "Mean time between output tokens of one finished sequence.", self.tpot)
            histogram("e2e_request_latency_seconds", "Time from arrival to the end of a request.", self.e2e)
            for phase, help_ in PHASES.items():
                histogram(f"request_{phase}_time_seconds", help_, self.phases[phase])
            histogram("request_prompt_tokens", "Prompt tokens of each finished request.", self.request_prompt_tokens)
            histogram("request_generation_tokens", "Generated tokens of each finished request (all its samples).",
                      self.request_generation_tokens)

        sample(family("num_requests_running", "gauge", "Requests in the running batch."), stat("num_running"))
        sample(family("num_requests_waiting", "gauge", "Requests waiting to be scheduled."), stat("num_waiting"))
        sample(family("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0 to 1)."),
               float(stat("kv_cache_usage", 0.0)))
        sample(family("num_free_kv_blocks", "gauge", "Free KV-cache blocks."), stat("num_free_blocks"))
        sample(family("num_total_kv_blocks", "gauge", "Total KV-cache blocks."), stat("num_total_blocks"))
        queries, hits = stat("prefix_cache_queries"), stat("prefix_cache_hits")
        sample(family("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache."),
               queries)
        sample(family("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache."), hits)
        sample(family("prefix_cache_hit_rate", "gauge", "prefix_cache_hits_total / prefix_cache_queries_total."),
               hits / queries if queries else 0.0)
        sample(family("num_preemptions_total", "counter", "Sequences preempted for lack of KV blocks."),
               stat("num_preemptions"))
        sample(family("engine_healthy", "gauge", "1 while the engine thread runs, else 0."), int(healthy))
        return "\n".join(out) + "\n"
