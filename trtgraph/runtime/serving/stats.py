"""What a run did: requests, tokens, steps per key, padding, preemptions, speculative
acceptance and (with gpu_timing) the device's idle time per step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RunStats:
    requests: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    fast_path_steps: int = 0
    real_tokens: int = 0  # query tokens of real rows, over all steps
    padded_tokens: int = 0  # query tokens the keys computed, over all steps
    preemptions: int = 0
    aborted: int = 0  # requests aborted while being served
    seconds: float = 0.0
    record_seconds: float = 0.0  # start-up: warm-up and re-recording of every key
    steps_per_key: Counter = field(default_factory=Counter)
    gpu_busy_seconds: float | None = None  # with gpu_timing: device time inside the steps' graphs
    speculative: bool = False  # the engine drafts (then the summary shows drafted vs plain steps)
    verify_steps: int = 0  # speculative steps
    verify_rows: int = 0  # sequence-steps in them
    drafted_rows: int = 0  # of those, rows whose K drafts came from an n-gram match
    drafts_fed: int = 0  # draft tokens fed (K per row, matched or filler)
    drafts_accepted: int = 0
    verify_tokens: int = 0  # tokens emitted by verify steps (accepted drafts + one bonus per row)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    @property
    def plain_decode_steps(self) -> int:
        """Generation steps that ran a plain decode key (no drafts)."""
        return sum(n for k, n in self.steps_per_key.items() if not k.is_prefill and not k.draft_len)

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def to_json(self) -> dict:
        return {"requests": self.requests, "refused": self.refused, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "seconds": round(self.seconds, 4),
                "record_seconds": round(self.record_seconds, 4),
                "tokens_per_second": round(self.tokens_per_second, 2), "steps": self.steps,
                "fast_path_steps": self.fast_path_steps, "padding_waste_pct": round(100 * self.padding_waste, 2),
                "preemptions": self.preemptions, **({"aborted": self.aborted} if self.aborted else {}),
                "steps_per_key": {str(k): v for k, v in sorted(self.steps_per_key.items())},
                **({} if not (self.verify_steps or self.speculative) else {
                    "speculative": {"verify_steps": self.verify_steps, "plain_decode_steps": self.plain_decode_steps,
                                    "drafted_rows": self.drafted_rows,
                                    "acceptance_rate": round(self.drafts_accepted / max(self.drafts_fed, 1), 4),
                                    "mean_tokens_per_row_step": round(self.verify_tokens / max(self.verify_rows, 1), 3)}}),
                **({} if self.gpu_busy_seconds is None else {
                    "gpu_busy_seconds": round(self.gpu_busy_seconds, 4),
                    "gpu_idle_per_step_us": round(1e6 * (self.seconds - self.gpu_busy_seconds) / max(self.steps, 1), 1)})}
