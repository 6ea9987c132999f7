"""Prometheus metrics of the server, in their own CollectorRegistry (never the process-wide
default): requests by outcome, tokens in and out, queue depth, running sequences, free KV
blocks, steps per key, padding waste, step wall time, GPU idle per step (CUDA only), TTFT
and TPOT. The engine thread updates them after each step from the engine's stats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
OUTCOMES = ("stop", "length", "error", "abort", "rejected")  # requests_total's


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "trtgraph_"
        self.requests = Counter(p + "requests", "Requests finished, by outcome (stop, length, error, abort, "
                                "rejected).", ["outcome"], registry=r)
        for outcome in OUTCOMES:  # each series from 0: one born at 1 hides its first count from rate()
            self.requests.labels(outcome)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests accepted that have produced nothing yet (read "
                                 "when scraped).", registry=r)
        self.running = Gauge(p + "running_sequences", "Sequences in the running batch.", registry=r)
        self.kv_free = Gauge(p + "kv_blocks_free", "KV cache blocks free (of kv_blocks_total).", registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "Allocatable KV cache blocks.", registry=r)
        self.steps = Counter(p + "steps", "Engine steps replayed, per graph key.", ["key"], registry=r)
        self.padding_waste = Gauge(p + "padding_waste_ratio", "Padded share of the tokens the replayed keys "
                                   "computed, since the engine last went idle.", registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Wall time of one engine step.",
                                      buckets=LATENCY_BUCKETS_S, registry=r)
        self.gpu_idle = Histogram(p + "gpu_idle_seconds_per_step", "Wall time of a step minus the GPU time "
                                  "inside its graphs (CUDA only).", buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival at the engine to first token.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", buckets=LATENCY_BUCKETS_S, registry=r)
        self._seen: dict = {}  # the engine stats object last seen and its counters then

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def after_step(self, engine, outputs, step_seconds: float) -> None:
        """Account one engine step: its outputs, and what the engine's stats gained."""
        for out in outputs:  # every completion's tokens come as deltas (the engine thread streams by choice)
            self.generation_tokens.inc(len(out.token_ids))
            if out.finished:
                self.finished(out.result)
        self.step_seconds.observe(step_seconds)
        self._stats_delta(engine.stats, step_seconds)
        self.sample(engine)

    def sample(self, engine) -> None:
        """The gauges read from the scheduler: after each step, and once the engine is loaded
        (an idle server reports its free KV blocks, not 0 of 0)."""
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.kv_free.set(sched.allocator.num_free)
        self.kv_total.set(sched.allocator.num_blocks - 1)

    def finished(self, result) -> None:
        self.requests.labels(result.finish_reason).inc()
        if result.ttft_ms is not None:
            self.ttft.observe(result.ttft_ms / 1e3)
        if result.tpot_ms is not None:
            self.tpot.observe(result.tpot_ms / 1e3)

    def _stats_delta(self, stats, step_seconds: float) -> None:
        """The engine's stats restart when it goes idle under generate(); count from zero then."""
        before = self._seen.get("counts") if self._seen.get("stats") is stats else None
        counts = {"prompt": stats.prompt_tokens, "keys": dict(stats.steps_per_key), "gpu": stats.gpu_busy_seconds}
        base = before or {"prompt": 0, "keys": {}, "gpu": None if stats.gpu_busy_seconds is None else 0.0}
        self.prompt_tokens.inc(counts["prompt"] - base["prompt"])
        for key, n in counts["keys"].items():
            if n > base["keys"].get(key, 0):
                self.steps.labels(str(key)).inc(n - base["keys"].get(key, 0))
        if counts["gpu"] is not None and base["gpu"] is not None:
            self.gpu_idle.observe(max(step_seconds - (counts["gpu"] - base["gpu"]), 0.0))
        self.padding_waste.set(stats.padding_waste)
        self._seen = {"stats": stats, "counts": counts}
