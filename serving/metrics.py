"""Prometheus metrics of one app (its own ``CollectorRegistry``: several apps in one process never collide).

Speculative-decoding counters follow vLLM's names under the ``edgespec:`` prefix (exposed with ``_total``):
mean acceptance length = 1 + accepted / drafts, per-position rate = accepted_per_pos{position=i} / drafts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from edgespec.energy import EnergyReading
from edgespec.speculative.telemetry import RequestTelemetry

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_TIME_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_JOULE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
_AL_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class ServerMetrics:
    """Counters, gauges and histograms the worker updates and ``GET /metrics`` renders."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = "edgespec:"
        self.drafts = Counter(p + "spec_decode_num_drafts",
                              "Verify cycles that carried at least one draft token.", registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                       registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position.", ["position"],
                                        registry=r)
        self.requests = Counter(p + "request_success", "Requests finished, by finish reason.",
                                ["finished_reason"], registry=r)
        self.failures = Counter(p + "request_failure", "Requests refused or failed, by reason.", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests being generated (0 or 1).", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued behind the running one.",
                             registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Time waiting for the engine.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to the first text.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram(p + "request_prefill_time_seconds", "Prefill time.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram(p + "request_decode_time_seconds", "First token to last token.",
                                buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Decode time per token after the first.",
                              buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.acceptance_length = Histogram(p + "request_acceptance_length",
                                           "Per-request mean acceptance length (requests with drafts).",
                                           buckets=_AL_BUCKETS, registry=r)
        self.ready = Gauge(p + "engine_ready", "1 once the model is loaded and serving.", registry=r)
        self.energy = Counter(p + "energy_joules", "Device energy spent generating (NVML or INA3221; absent on CPU).",
                              registry=r)
        self.joules_per_token = Histogram(p + "request_joules_per_token", "Per-request device energy per generated "
                                          "token.", buckets=_JOULE_BUCKETS, registry=r)
        self.avg_watts = Gauge(p + "request_avg_watts", "Average device power of the last finished request.",
                               registry=r)
        self.preemptions = Counter(p + "request_preemptions", "Long generations paused for a short request.",
                                   registry=r)
        self.connections_refused = Counter(
            p + "connection_refusals", "Connections the connection layer answered and closed before the app, by "
            "reason: too_many_connections / client_connections / evicted (503), request_timeout (408), "
            "invalid_http (400).", ["reason"], registry=r)
        self.connections_open = Gauge(p + "connections_open", "Open HTTP connections.", registry=r)

    def observe(self, tel: RequestTelemetry, finish_reason: str, *, queue_s: float, e2e_s: float,
                ttft_s: float | None, energy: EnergyReading | None = None) -> None:
        """Record one finished request."""
        if energy is not None:
            self.energy.inc(max(0.0, energy.joules))
            self.avg_watts.set(energy.watts)
            per_token = energy.per_token(tel.generated_tokens)
            if per_token is not None:
                self.joules_per_token.observe(per_token)
        self.requests.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(tel.prompt_tokens)
        self.generation_tokens.inc(tel.generated_tokens)
        self.drafts.inc(tel.drafts)
        self.draft_tokens.inc(tel.draft_tokens)
        self.accepted_tokens.inc(tel.accepted_tokens)
        for i, n in enumerate(tel.accepted_per_pos):
            self.accepted_per_pos.labels(position=str(i)).inc(n)
        self.queue_time.observe(queue_s)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.prefill.observe(tel.stage_ms.get("prefill", 0.0) / 1000.0)
        self.decode.observe(tel.decode_ms / 1000.0)
        if tel.generated_tokens > 1 and tel.decode_ms > 0:
            self.tpot.observe(tel.decode_ms / 1000.0 / (tel.generated_tokens - 1))
        if tel.drafts:
            self.acceptance_length.observe(tel.acceptance_length)

    def fail(self, reason: str) -> None:
        self.failures.labels(reason=reason).inc()

    def refuse_connection(self, reason: str) -> None:
        self.connections_refused.labels(reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
