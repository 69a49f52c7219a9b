"""Server counters and gauges, rendered in the Prometheus text exposition format (version 0.0.4).

Written by the event loop (request outcomes) and the generation worker (tokens, speculation);
a lock keeps the two consistent. Rendering needs no client library: the format is plain text.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Upper bounds (seconds) of the time-to-first-token histogram buckets.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


@dataclass
class GenerationRecord:
    """What one finished (or cancelled) generation contributes to the metrics."""

    n_prompt_tokens: int
    n_tokens: int
    t_decode_s: float          # wall time after the prefill (GenStats.t_total_s - t_prefill_s)
    n_drafted: int
    n_accepted: int
    gamma_mean: float | None   # mean draft length per cycle of this generation (None: no cycle ran)
    ttft_s: float | None       # queue wait + prefill + first token; None when no token came
    outcome: str               # stop | length | eos | cancelled | timeout | error


# Paths counted under their own `endpoint` label; any other path counts as "other" (a bounded label set).
# Routes added beside these (Ollama's /api/*) name theirs with Metrics.name_endpoints.
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})


class Metrics:
    def __init__(self, model: str = "") -> None:
        self._lock = threading.Lock()
        self.model = model
        self.endpoints: set[str] = set(ENDPOINTS)
        self.endpoint_prefixes: tuple[str, ...] = ()
        self.requests: Counter[tuple[str, int]] = Counter()      # (endpoint, HTTP status) -> count
        self.generations: Counter[str] = Counter()               # outcome -> count
        self.prompt_tokens = 0
        self.tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.decode_seconds = 0.0
        self.last_tokens_per_s = 0.0
        self.gamma: float | None = None
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.ttft_n = 0

    def name_endpoints(self, paths, prefixes=()) -> None:
        """Count requests to these paths under their own endpoint label, and a path below one of `prefixes`
        (a route with a parameter, e.g. /api/blobs/{digest}) under the prefix."""
        self.endpoints.update(paths)
        self.endpoint_prefixes += tuple(prefixes)

    def endpoint_of(self, path: str) -> str:
        """The `endpoint` label of a request path: the path itself for a named route, else "other"."""
        if path in self.endpoints:
            return path
        return next((p for p in self.endpoint_prefixes if path.startswith(p + "/")), "other")

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1

    def record_generation(self, rec: GenerationRecord) -> None:
        with self._lock:
            self.generations[rec.outcome] += 1
            self.prompt_tokens += rec.n_prompt_tokens
            self.tokens += rec.n_tokens
            self.drafted += rec.n_drafted
            self.accepted += rec.n_accepted
            if rec.n_tokens > 0 and rec.t_decode_s > 0:
                self.decode_seconds += rec.t_decode_s
                self.last_tokens_per_s = rec.n_tokens / rec.t_decode_s      # as GenStats.tokens_per_s
            if rec.gamma_mean is not None:
                self.gamma = rec.gamma_mean
            if rec.ttft_s is not None:
                i = next((k for k, b in enumerate(TTFT_BUCKETS) if rec.ttft_s <= b), len(TTFT_BUCKETS))
                self.ttft_counts[i] += 1
                self.ttft_sum += rec.ttft_s
                self.ttft_n += 1

    def observe_gamma(self, gamma: float) -> None:
        with self._lock:
            self.gamma = gamma

    def render(self, *, queue_depth: int, queue_limit: int, busy: bool, ready: bool, slots: int = 1,
               running: int | None = None, batch: tuple[int, int, float, int] = (0, 0, 0.0, 0),
               prompt_cache: tuple[int, int, int, int] = (0, 0, 0, 0), gpu: dict | None = None,
               suffix_history: list[tuple[str, int, int, int]] | None = None) -> str:
        """The exposition text. Live values (queue, readiness) are passed in by the caller."""
        with self._lock:
            out: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} {kind}")
                for labels, value in samples:
                    out.append(f"{name}{labels} {_num(value)}")

            metric("edgerun_requests_total", "counter", "HTTP requests answered, by endpoint (the route: /v1/* OpenAI, /api/* Ollama) and status code.",
                   [(f'{{endpoint="{_escape(e)}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("edgerun_generations_total", "counter", "Generations run, by how they ended.",
                   [(f'{{outcome="{_escape(o)}"}}', n) for o, n in sorted(self.generations.items())])
            metric("edgerun_prompt_tokens_total", "counter", "Prompt tokens processed.", [("", self.prompt_tokens)])
            metric("edgerun_tokens_generated_total", "counter", "Tokens generated.", [("", self.tokens)])
            metric("edgerun_draft_tokens_total", "counter", "Tokens proposed by the drafter.", [("", self.drafted)])
            metric("edgerun_draft_tokens_accepted_total", "counter", "Drafted tokens the target accepted.",
                   [("", self.accepted)])
            metric("edgerun_decode_seconds_total", "counter", "Seconds spent decoding (after the prefill).",
                   [("", self.decode_seconds)])
            metric("edgerun_tokens_per_second", "gauge", "Decode speed of the last finished generation.",
                   [("", self.last_tokens_per_s)])
            rate = self.accepted / self.drafted if self.drafted else float("nan")
            metric("edgerun_acceptance_rate", "gauge", "Accepted / drafted tokens since start (NaN before any draft).",
                   [("", rate)])
            metric("edgerun_gamma", "gauge", "Mean draft length per cycle in the last generation (0: speculation off).",
                   [("", float(self.gamma or 0))])
            out.append("# HELP edgerun_time_to_first_token_seconds Queue wait + prefill + first token.")
            out.append("# TYPE edgerun_time_to_first_token_seconds histogram")
            cum = 0
            for bound, n in zip(TTFT_BUCKETS, self.ttft_counts):
                cum += n
                out.append(f'edgerun_time_to_first_token_seconds_bucket{{le="{_num(bound)}"}} {cum}')
            cum += self.ttft_counts[-1]
            out.append(f'edgerun_time_to_first_token_seconds_bucket{{le="+Inf"}} {cum}')
            out.append(f"edgerun_time_to_first_token_seconds_sum {_num(self.ttft_sum)}")
            out.append(f"edgerun_time_to_first_token_seconds_count {self.ttft_n}")
            metric("edgerun_queue_depth", "gauge", "Requests waiting for the generation worker.", [("", queue_depth)])
            metric("edgerun_queue_limit", "gauge", "Most requests allowed to wait; more get 503.", [("", queue_limit)])
            metric("edgerun_busy", "gauge", "1 while a generation runs.", [("", int(busy))])
            metric("edgerun_slots", "gauge", "Generations that can run at once (--parallel).", [("", slots)])
            metric("edgerun_running", "gauge", "Generations running now.",
                   [("", int(busy) if running is None else running)])
            metric("edgerun_prompt_cache_hits_total", "counter",
                   "Requests whose prompt prefix was restored from the prompt cache instead of evaluated.",
                   [("", prompt_cache[0])])
            metric("edgerun_prompt_cache_restored_tokens_total", "counter",
                   "Prompt positions restored from the prompt cache (not evaluated).", [("", prompt_cache[1])])
            metric("edgerun_prompt_cache_bytes", "gauge", "RAM held by the prompt cache.", [("", prompt_cache[2])])
            metric("edgerun_prompt_cache_entries", "gauge", "Sequences held by the prompt cache.",
                   [("", prompt_cache[3])])
            metric("edgerun_batch_steps_total", "counter", "Batched evaluations (continuous batching; 0 with one slot).",
                   [("", batch[0])])
            metric("edgerun_batch_rows_total", "counter", "Rows (positions of all sequences) in those evaluations.",
                   [("", batch[1])])
            metric("edgerun_batch_eval_seconds_total", "counter",
                   "Wall time inside those evaluations (llama_decode and the logits copies).",
                   [("", batch[2])])
            metric("edgerun_batch_moves_total", "counter",
                   "Running sequences moved to a lower free id, closing a gap a finished one left.",
                   [("", batch[3])])
            _optional_metrics(metric, gpu, suffix_history)
            metric("edgerun_ready", "gauge", "1 once the models are loaded.",
                   [(f'{{model="{_escape(self.model)}"}}', int(ready))])
            return "\n".join(out) + "\n"


def _optional_metrics(metric, gpu: dict | None, suffix_history: list | None) -> None:
    """The metrics that exist only in some services: where the target's layers run (once loaded) and the
    suffix history (--suffix-history)."""
    if gpu is not None:          # where the target's layers run (device/gpu.py), once loaded
        metric("edgerun_backend_info", "gauge",
               "1, labelled with the device the target's layers run on and the GPU backend the device "
               "profile expects (none: a CPU profile).",
               [(f'{{device="{_escape(gpu["device"])}",expected="{_escape(gpu["expected"] or "none")}"}}',
                 1)])
        metric("edgerun_gpu_layers", "gauge", "The target's layers on a GPU (of edgerun_model_layers).",
               [("", gpu["gpu_layers"] if gpu["gpu_layers"] is not None else float("nan"))])
        metric("edgerun_model_layers", "gauge", "The target's layers (blocks + output), as llama.cpp counts.",
               [("", gpu["n_layers"] if gpu["n_layers"] is not None else float("nan"))])
        metric("edgerun_gpu_problem", "gauge", "1 when the profile expects a GPU that the target does not "
               "use (the log and /health say why and what fixes it).", [("", int(gpu["problem"] is not None))])
    if suffix_history is not None:   # --suffix-history: (key label, tokens held, hits, drafted) per key
        keys = [f'{{key="{_escape(k)}"}}' for k, _, _, _ in suffix_history]
        metric("edgerun_suffix_history_tokens", "gauge",
               "Tokens of earlier answers held for suffix drafts, by API key (1, 2, ... in the key file's "
               "order; none: a keyless server).", [(k, r[1]) for k, r in zip(keys, suffix_history)])
        metric("edgerun_suffix_history_hits_total", "counter",
               "Drafts proposed from earlier answers, by API key.",
               [(k, r[2]) for k, r in zip(keys, suffix_history)])
        metric("edgerun_suffix_history_draft_tokens_total", "counter",
               "Tokens in those drafts, by API key.", [(k, r[3]) for k, r in zip(keys, suffix_history)])
