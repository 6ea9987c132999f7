"""Admission: a request becomes a Sequence (prompt ids, resolved sampling fields, a seed), or
the reason no recorded key of this engine can serve it, which comes back as an error Result.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from operator import attrgetter

from ...errors import PromptError
from ...limits import MAX_STOP_IDS
from .outcomes import RowFacts
from .requests import Request, Result, resolve_sampling_defaults
from .sampling_params import SAMPLING_FIELDS, SamplingParams
from .scheduler import Sequence

TEXT_SLACK = 8  # characters a normalizer may fold into one (NFC composes up to 4: α + 3 marks)
RESOLVED_CACHE = 4096  # distinct sampling fields kept resolved (then the cache starts afresh)
_BUT_SEED = attrgetter(*(f for f in SAMPLING_FIELDS if f != "seed"))  # a request's sampling fields but its seed


class Refusal(str):
    """A refusal's text with the native field it names (`param`) and OpenAI's `code`, which the
    OpenAI formats report (formats/openai.py). The context's: code `context_length_exceeded`,
    param "prompt" where the prompt alone leaves no room, else "max_tokens"."""

    def __new__(cls, text: str, param: str, code: str | None = None):
        self = super().__new__(cls, text)
        self.param, self.code = param, code
        return self


def _over(text: str, param: str) -> Refusal:
    return Refusal(text, param, "context_length_exceeded")


def _refused(req: Request, fail: str, prompt_tokens: int) -> Result:
    """The error Result of a refusal (a Refusal's code and field kept)."""
    return Result(id=req.id, finish_reason="error", error=str(fail), prompt_tokens=prompt_tokens,
                  error_code=getattr(fail, "code", None), error_param=getattr(fail, "param", None))


@dataclass
class _Resolved:
    """What admission derives from a request's sampling fields alone (its seed aside), kept for
    the requests that share them: resolving costs tens of µs, and requests mostly differ only
    in their prompts and seeds."""
    sampling: SamplingParams  # resolved with the model's defaults (the seed of the first request seen)
    facts: RowFacts  # what every step reads of a request with these fields (Sequence.facts)
    refusals: dict = field(default_factory=dict)  # speculative -> why these fields cannot be served, or None


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
    # a request's sampling fields but its seed -> _Resolved: requests mostly share them, and
    # resolving (a validated copy) costs more than the rest of admission
    _resolved: dict = field(default_factory=dict, repr=False)

    def admit(self, req: Request, arrival: float, speculative: bool) -> Sequence | Result:
        """A Sequence, or an error Result when no recorded key can serve the request. Sampling
        fields the request left out take the model's generation_config.json defaults.
        speculative: whether a drafter proposes tokens now."""
        ids, fail = self._prompt_ids(req)
        if fail is None and req.sampling.fills_context:
            req, fail = self._to_context(req, len(ids))
        if fail:
            return _refused(req, fail, len(ids))
        req, known = self._resolve(req)
        fail = self._refusal(req, ids, speculative, known)
        if fail:
            return _refused(req, fail, len(ids))
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        seq = Sequence(request=req, arrival=arrival, prompt_ids=ids, seed=seed)
        if known is not None:
            seq._facts = known.facts  # (shared: RowFacts is frozen)
        return seq

    def fit(self, req: Request) -> tuple[Request, Result | None]:
        """A request whose prompt is ids already (`prepare`) fitted to the context as `admit` fits
        it: max_tokens "context" resolved, or the refusal by limits.max_seq_len admit would give.
        For the server, which answers those before submitting."""
        prompt = len(req.prompt_token_ids)
        if req.sampling.fills_context:
            req, fail = self._to_context(req, prompt)
        else:
            fail = self._over_context(prompt, req.sampling.max_tokens)
        return req, _refused(req, fail, prompt) if fail else None

    def _over_context(self, prompt: int, max_tokens: int) -> Refusal | None:
        if prompt + max_tokens <= self.max_seq_len:
            return None
        return _over(f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {prompt + max_tokens} exceeds the "
                     f"manifest's limits.max_seq_len ({self.max_seq_len})",
                     "prompt" if prompt >= self.max_seq_len else "max_tokens")

    def _to_context(self, req: Request, prompt: int) -> tuple[Request, str | None]:
        """max_tokens "context" (an OpenAI chat without a max): what limits.max_seq_len leaves after
        the prompt's `prompt` tokens, or (req, why nothing is left)."""
        left, limit = self.max_seq_len - prompt, self.max_seq_len
        if left < 1:
            return req, _over(f"the prompt ({prompt} tokens) fills the manifest's limits.max_seq_len ({limit}), "
                              f"leaving no room for a reply; shorten "
                              f"{'the messages' if req.messages is not None else 'the prompt'}", "prompt")
        if req.sampling.min_tokens > left:
            return req, Refusal(f"min_tokens ({req.sampling.min_tokens}) is more than the {left} tokens the "
                                f"manifest's limits.max_seq_len ({limit}) leaves after the prompt ({prompt} tokens)",
                                "min_tokens")
        return req.with_sampling(replace(req.sampling, max_tokens=left)), None

    def _resolve(self, req: Request) -> tuple[Request, _Resolved | None]:
        """resolve_sampling_defaults(req, generation), with what its sampling fields imply (None
        where they do not hash), kept by their values but the seed: the request's own seed is
        put into the kept resolved fields (a copy; nothing to validate again)."""
        try:
            key = _BUT_SEED(req.sampling)
            known = self._resolved.get(key)
        except TypeError:  # a field that does not hash (never from parse_request): resolve it each time
            return resolve_sampling_defaults(req, self.generation), None
        if known is None:
            if len(self._resolved) >= RESOLVED_CACHE:
                self._resolved.clear()
            resolved = resolve_sampling_defaults(req, self.generation)
            known = self._resolved[key] = _Resolved(resolved.sampling, RowFacts.of(resolved))
            return resolved, known
        sampling = known.sampling
        if sampling.seed != req.sampling.seed:
            sampling = object.__new__(SamplingParams)  # the kept fields with this request's seed
            sampling.__dict__.update(known.sampling.__dict__, seed=req.sampling.seed)
        return req.with_sampling(sampling), known

    def _sampling_refusal(self, req: Request, speculative: bool) -> str | None:
        """Why this engine cannot serve the request's sampling fields exactly, or None."""
        s, cfg = req.sampling, self.model_config
        if s.uses_penalties and speculative:
            return ("repetition / presence / frequency penalties are not supported with speculative decoding "
                    "(draft tokens would count before they are accepted); run with speculative decoding off "
                    "(`trtgraph run --no-speculative`, `LLM(..., speculative=False)`)")
        if (s.logit_bias or s.min_tokens) and self.tensor_parallel:
            return "logit_bias and min_tokens are not supported with tensor parallelism yet"
        masked = {t for t in set(cfg.eos_token_ids) | set(self.generation.eos_token_ids) | set(s.stop_token_ids)
                  if t < cfg.vocab_size}  # as the launcher masks them
        if s.min_tokens and len(masked) > MAX_STOP_IDS:
            return (f"min_tokens masks the EOS and stop token ids, at most {MAX_STOP_IDS} of them; this request "
                    f"has {len(masked)}")
        bad = [t for t, _ in s.logit_bias if t >= cfg.vocab_size]
        if bad:
            return f"logit_bias token id {bad[0]} is outside the vocabulary (size {cfg.vocab_size})"
        return None

    def _refusal(self, req: Request, ids: list[int], speculative: bool, known: _Resolved | None = None) -> str | None:
        """Why no recorded key can serve this prompt, or None. known: what its sampling fields
        imply (their refusal is looked up once per distinct fields)."""
        cfg = self.model_config
        if not ids:
            return "the prompt encodes to no tokens"
        top, low = max(ids), min(ids)
        if top >= cfg.vocab_size or low < 0:  # (a Request built in Python skips parse_request's check)
            return (f"prompt token id {top if top >= cfg.vocab_size else low} is outside the vocabulary "
                    f"(size {cfg.vocab_size})")
        over = self._over_context(len(ids), req.max_tokens if known is None else known.facts.max_tokens)
        if over:
            return over
        if known is None:
            return self._fields_refusal(req, speculative)
        if speculative not in known.refusals:
            known.refusals[speculative] = self._fields_refusal(req, speculative)
        return known.refusals[speculative]

    def _fields_refusal(self, req: Request, speculative: bool) -> str | None:
        """Why no recorded key can serve the request's sampling fields, or None."""
        if not req.is_greedy and not self.has_sampled:
            return ("temperature > 0, a logits processor or logprobs need sampled graphs, but this manifest "
                    "holds only greedy keys; recapture with buckets.sampling: [greedy, sampled], or send "
                    "temperature 0 without them")
        return self._sampling_refusal(req, speculative)

    def prepare(self, req: Request) -> tuple[Request, Result | None]:
        """The request with its prompt as token ids (text encoded, chat `messages` rendered with the
        checkpoint's template and encoded), or (req, the refusal admit would give it). For a caller
        off the engine thread (the server's request handler): rendering a long conversation or
        encoding a long text there holds no step of other requests. The template and the tokenizer
        are only read, so this may run beside the engine; admit then takes the ids as given."""
        if req.prompt_token_ids is not None:
            return req, None
        ids, fail = self._prompt_ids(req)
        if fail:
            return req, _refused(req, fail, 0)
        return Request(id=req.id, prompt_token_ids=ids, sampling=req.sampling, n=req.n), None

    def _prompt_ids(self, req: Request) -> tuple[list[int], str | None]:
        """The request's prompt as token ids: given, encoded text, or a chat rendered with the
        checkpoint's template. (ids, None) or ([], why not)."""
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids), None
        if req.messages is None:
            return self._encode(req.prompt, True)
        if self.chat_template is None:
            where = self.checkpoint_dir or "the synthetic model"
            return [], (f"{where} has no chat template (no `chat_template` in tokenizer_config.json and no "
                        f"chat_template.jinja), so it cannot serve `messages`; send `prompt` text instead")
        try:
            text = self.chat_template.render(req.chat_messages, add_generation_prompt=True)
        except PromptError as exc:
            return [], str(exc)
        return self._encode(text, False)

    def _encode(self, text: str, special: bool) -> tuple[list[int], str | None]:
        """The text's ids, or ([], why not) for text longer than any prompt that fits, refused
        before encoding where the tokenizer bounds the characters a token covers
        (`max_token_chars`): encoding holds the interpreter (30 MB took 82 s on the CPU machine,
        every other request of a server waiting). TEXT_SLACK allows for a normalizer that folds
        characters into one (NFC)."""
        per_token = getattr(self.tokenizer, "max_token_chars", None)
        most = self.max_seq_len * per_token * TEXT_SLACK if per_token else None
        if most is not None and len(text) > most:
            return [], _over(f"the prompt's text ({len(text):,} characters) cannot fit limits.max_seq_len "
                             f"({self.max_seq_len} tokens): no token of this tokenizer covers more than {per_token} "
                             f"characters (refused before encoding, past {most:,} characters); shorten the prompt",
                             "prompt")
        return self.tokenizer.encode(text, add_special_tokens=special), None
