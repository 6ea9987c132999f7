"""Admission: a request becomes a Sequence (prompt ids, resolved sampling fields, a seed), or
the reason no recorded key of this engine can serve it, which comes back as an error Result.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from ...errors import PromptError
from ...limits import MAX_STOP_IDS
from .requests import Request, Result, resolve_sampling_defaults
from .scheduler import Sequence

RESOLVED_CACHE = 4096  # distinct sampling fields kept resolved (then the cache starts afresh)


@dataclass
class Admission:
    tokenizer: object
    chat_template: object | None  # the checkpoint's template (None: `messages` are refused)
    model_config: object  # ModelConfig: vocab size, EOS ids
    generation: object  # generation_config.json: sampling defaults
    checkpoint_dir: object | None  # where the chat template would come from (None: synthetic)
    max_seq_len: int
    has_sampled: bool  # the manifest holds sampled keys
    tensor_parallel: bool
    # SamplingParams as sent -> resolved with the model's defaults: requests mostly share their
    # sampling fields, and resolving (a validated copy) costs more than the rest of admission
    _resolved: dict = field(default_factory=dict, repr=False)

    def admit(self, req: Request, arrival: float, speculative: bool) -> Sequence | Result:
        """A Sequence, or an error Result when no recorded key can serve the request. Sampling
        fields the request left out take the model's generation_config.json defaults.
        speculative: whether a drafter proposes tokens now."""
        req = self._resolve(req)
        ids, fail = self._prompt_ids(req)
        if fail is None:
            fail = self._refusal(req, ids, speculative)
        if fail:
            return Result(id=req.id, finish_reason="error", error=fail, prompt_tokens=len(ids))
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        return Sequence(request=req, arrival=arrival, prompt_ids=ids, seed=seed)

    def _resolve(self, req: Request) -> Request:
        """resolve_sampling_defaults(req, generation), its resolved sampling fields kept by value."""
        try:
            sampling = self._resolved.get(req.sampling)
        except TypeError:  # a field that does not hash (never from parse_request): resolve it each time
            return resolve_sampling_defaults(req, self.generation)
        if sampling is None:
            if len(self._resolved) >= RESOLVED_CACHE:
                self._resolved.clear()
            sampling = self._resolved[req.sampling] = resolve_sampling_defaults(req, self.generation).sampling
        return req.with_sampling(sampling)

    def _sampling_refusal(self, req: Request, speculative: bool) -> str | None:
        """Why this engine cannot serve the request's sampling fields exactly, or None."""
        s, cfg = req.sampling, self.model_config
        if s.uses_penalties and speculative:
            return ("repetition / presence / frequency penalties are not supported with speculative decoding "
                    "(draft tokens would count before they are accepted); run with speculative decoding off")
        if (s.logit_bias or s.min_tokens) and self.tensor_parallel:
            return "logit_bias and min_tokens are not supported with tensor parallelism yet"
        if s.min_tokens and len(set(cfg.eos_token_ids) | set(s.stop_token_ids)) > MAX_STOP_IDS:
            return (f"min_tokens masks the EOS and stop token ids, at most {MAX_STOP_IDS} of them; this request "
                    f"has {len(set(cfg.eos_token_ids) | set(s.stop_token_ids))}")
        bad = [t for t, _ in s.logit_bias if t >= cfg.vocab_size]
        if bad:
            return f"logit_bias token id {bad[0]} is outside the vocabulary (size {cfg.vocab_size})"
        return None

    def _refusal(self, req: Request, ids: list[int], speculative: bool) -> str | None:
        """Why no recorded key can serve this prompt, or None."""
        cfg = self.model_config
        if not ids:
            return "the prompt encodes to no tokens"
        if max(ids) >= cfg.vocab_size:
            return f"prompt token id {max(ids)} is outside the vocabulary (size {cfg.vocab_size})"
        if len(ids) + req.max_tokens > self.max_seq_len:
            return (f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) = {len(ids) + req.max_tokens} "
                    f"exceeds the manifest's limits.max_seq_len ({self.max_seq_len})")
        if not req.is_greedy and not self.has_sampled:
            return ("temperature > 0, a logits processor or logprobs need sampled graphs, but this manifest "
                    "holds only greedy keys; recapture with buckets.sampling: [greedy, sampled], or send "
                    "temperature 0 without them")
        return self._sampling_refusal(req, speculative)

    def _prompt_ids(self, req: Request) -> tuple[list[int], str | None]:
        """The request's prompt as token ids: given, encoded text, or a chat rendered with the
        checkpoint's template. (ids, None) or ([], why not)."""
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids), None
        if req.messages is None:
            return self.tokenizer.encode(req.prompt), None
        if self.chat_template is None:
            where = self.checkpoint_dir or "the synthetic model"
            return [], (f"{where} has no chat template (no `chat_template` in tokenizer_config.json and no "
                        f"chat_template.jinja), so it cannot serve `messages`; send `prompt` text instead")
        try:
            text = self.chat_template.render(req.chat_messages, add_generation_prompt=True)
        except PromptError as exc:
            return [], str(exc)
        return self.tokenizer.encode(text, add_special_tokens=False), None
