"""SamplingParams: every sampling field of a request, validated on construction (the
JSONL, OpenAI and Python paths all build one), and the limits the device tables hold."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ...errors import PromptError
from ...fields import FieldChecker
from ...inputs import is_int, is_number, short, text_problem
from ...limits import LOGIT_BIAS_CAPACITY, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS  # noqa: F401  (re-exported)

# The smallest repetition penalty: a seen token's positive logit is divided by it, and far below
# this (1e-38 and less) the quotient overflows fp32, the probabilities turn NaN and every draw is
# garbage, silently. 0.01 (a 100x boost) is already past any use; 1 is off.
MIN_REPETITION_PENALTY = 0.01

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos", "logit_bias", "logprobs")
MAX_TOKENS_CAP = 1 << 20
# `max_tokens` that runs a request to the end of the context: limits.max_seq_len less its prompt,
# resolved at admission once the prompt is encoded (an OpenAI chat without a max, as OpenAI and vLLM).
TO_CONTEXT = "context"
MAX_TOKENS_EXPECTED = (f'an integer in [1, {MAX_TOKENS_CAP}], or "{TO_CONTEXT}" (to the end of the context: '
                       f"limits.max_seq_len less the prompt)")
MAX_N = 16  # completions of one prompt (`n`)
# Stop strings are looked for in a request's text at every step it draws in (and held back from
# its stream while they could be starting): bounded, so one request cannot stall every other's steps.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
# What an omitted temperature / top_p / top_k means until the checkpoint's generation_config
# is consulted: greedy, no top-p, no top-k.
SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


class _FieldError(PromptError):
    """A bad sampling field; `detail` is the message without its location."""

    def __init__(self, detail: str):
        super().__init__(f"SamplingParams: {detail}")
        self.detail = detail


class RequestFields(FieldChecker):
    """A request's checks: `field `name` = value is not allowed; expected ...`, prefixed by
    `where` (`prompts.jsonl line 3`) as a PromptError, or without a place as a _FieldError
    (SamplingParams built from Python; `from_json` adds the place)."""

    def __init__(self, where: str | None = None):
        self.where = where

    def fail(self, name, value, expected):
        detail = f"field `{name}` = {short(value)} is not allowed; expected {expected}."
        if self.where is None:
            raise _FieldError(detail)
        raise PromptError(f"{self.where}: {detail}")


_CHECK = RequestFields()


@dataclass(frozen=True)
class SamplingParams:
    """Every sampling field of a request, validated on construction exactly as a JSONL line's
    fields are (the JSONL path builds one). temperature / top_p / top_k are None when omitted:
    `resolved()` fills them from the model's defaults (greedy, 1.0, 0 until generation_config
    is read). stop: strings and token ids (vLLM's `stop_token_ids=[...]` joins them).
    logit_bias: {token id: bias in [-100, 100]} (OpenAI),
    at most LOGIT_BIAS_CAPACITY entries, kept as sorted (id, bias) pairs. logprobs: None (off)
    or N in [0, 20] alternatives per generated token, from the raw model logits. n: completions
    of each prompt (a request field: LLM.generate gives it to each request, as a `sampling`
    dict's `n`; a Request keeps its own). max_tokens: an int, or TO_CONTEXT ("context"): as many as
    limits.max_seq_len leaves after the prompt, resolved when the engine admits the request."""
    max_tokens: int | str = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: tuple = ()
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        set_, c = object.__setattr__, _CHECK
        for name in SAMPLING_FIELDS + ("n",):  # numpy numbers (np.float32 temperature, np.int64 ids) as the Python ones
            if type(val := getattr(self, name)) not in _PLAIN_TYPES:
                set_(self, name, _plain(val))
        if isinstance(self.max_tokens, str) and self.max_tokens == TO_CONTEXT:
            set_(self, "max_tokens", TO_CONTEXT)  # (a str subclass as the plain one)
        else:
            c.integer(self.max_tokens, "max_tokens", 1, MAX_TOKENS_CAP, expected=MAX_TOKENS_EXPECTED)
        c.integer(self.n, "n", 1, MAX_N)
        for name, lo, hi in (("temperature", 0.0, 100.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                             ("repetition_penalty", MIN_REPETITION_PENALTY, 2.0), ("presence_penalty", -2.0, 2.0),
                             ("frequency_penalty", -2.0, 2.0)):
            val = getattr(self, name)
            if val is not None or name not in SAMPLING_DEFAULTS:
                set_(self, name, c.number(val, name, lo, hi, expected=f"a number in [{lo:g}, {hi:g}]"))
        if self.top_p == 0.0:
            c.fail("top_p", self.top_p, "a number in (0, 1]")
        if self.top_k is not None:
            c.integer(self.top_k, "top_k", 0, 1 << 24, expected=f"an integer in [0, {1 << 24}] (0 = no top-k)")
        if self.seed is not None:
            c.integer(self.seed, "seed", 0, (1 << 63) - 1, expected="an integer in [0, 2**63)")
        if self.fills_context:  # checked against what the context leaves at admission
            c.integer(self.min_tokens, "min_tokens", 0, MAX_TOKENS_CAP)
        else:
            c.integer(self.min_tokens, "min_tokens", 0, self.max_tokens,
                      expected=f"an integer in [0, max_tokens = {self.max_tokens}]")
        c.flag(self.ignore_eos, "ignore_eos")
        if self.logprobs is not None:
            c.integer(self.logprobs, "logprobs", 0, MAX_LOGPROBS,
                      expected=f"an integer in [0, {MAX_LOGPROBS}] (alternatives per token)")
        set_(self, "stop", _stops(self.stop))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            c.fail("stop", self.stop, f"at most {MAX_STOP_TOKEN_IDS} token ids")
        strings = self.stop_strings
        if len(strings) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in strings):
            c.fail("stop", self.stop, f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} "
                                      f"characters (each is looked for in the text at every step)")
        set_(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def fills_context(self) -> bool:
        """max_tokens is TO_CONTEXT: what limits.max_seq_len leaves after the prompt."""
        return isinstance(self.max_tokens, str)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in self.stop if isinstance(s, str))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(s for s in self.stop if not isinstance(s, str))

    @property
    def uses_penalties(self) -> bool:
        """Needs the per-sequence token counts on the device."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_processors(self) -> bool:
        """Any logits processor that changes the logits before temperature (min_p is a filter)."""
        return self.uses_penalties or bool(self.logit_bias) or self.min_tokens > 0

    def resolved(self, defaults: dict | None = None) -> "SamplingParams":
        """A copy with omitted temperature / top_p / top_k filled from `defaults` (the model's
        generation_config), else SAMPLING_DEFAULTS."""
        fill = {**SAMPLING_DEFAULTS, **(defaults or {})}
        return replace(self, **{k: fill[k] for k in SAMPLING_DEFAULTS if getattr(self, k) is None})

    @classmethod
    def from_json(cls, raw: dict, where: str) -> "SamplingParams":
        """The sampling fields of a request object; errors name `where`."""
        try:
            return cls(**{k: raw[k] for k in SAMPLING_FIELDS if raw.get(k) is not None})
        except _FieldError as exc:
            raise PromptError(f"{where}: {exc.detail}") from None


def with_stop_token_ids(stop, stop_token_ids) -> tuple:
    """`stop` with vLLM's `stop_token_ids` after it (each a non-negative integer, named so when not)."""
    ids = _plain(stop_token_ids)
    if is_int(ids):
        ids = [ids]
    if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
        _CHECK.fail("stop_token_ids", stop_token_ids, "a list of non-negative token ids")
    stop = () if stop is None else ((stop,) if isinstance(stop, str) or is_int(_plain(stop)) else stop)
    if not isinstance(stop, (list, tuple)):
        _CHECK.fail("stop", stop, "a string, a token id, or a list of them")
    return (*stop, *ids)


def _taking_stop_token_ids(init):
    """SamplingParams(..., stop_token_ids=[...]) as vLLM spells it: the ids join `stop`."""
    def __init__(self, *args, stop_token_ids=None, **kwargs):
        if stop_token_ids is not None:
            if len(args) > _STOP_AT:
                args = (*args[:_STOP_AT], with_stop_token_ids(args[_STOP_AT], stop_token_ids), *args[_STOP_AT + 1:])
            else:
                kwargs["stop"] = with_stop_token_ids(kwargs.get("stop"), stop_token_ids)
        init(self, *args, **kwargs)

    import inspect

    sig = inspect.signature(init)
    __init__.__signature__ = sig.replace(parameters=[*sig.parameters.values(), inspect.Parameter(
        "stop_token_ids", inspect.Parameter.KEYWORD_ONLY, default=None)])
    return __init__


_STOP_AT = [f.name for f in fields(SamplingParams)].index("stop")
SamplingParams.__init__ = _taking_stop_token_ids(SamplingParams.__init__)

_PLAIN_TYPES = frozenset({int, float, bool, str, type(None)})


def _plain(value):
    """A numpy scalar as the Python number it holds; in a list, tuple or dict (keys too), one level deep."""
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_scalar(v) for v in value)
    if isinstance(value, dict):
        return {_plain_scalar(k): _plain_scalar(v) for k, v in value.items()}
    return _plain_scalar(value)


def _plain_scalar(value):
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _stops(stop) -> tuple:
    """Strings and token ids, in order."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) or is_int(stop) else stop
    if not isinstance(items, (list, tuple)):
        _CHECK.fail("stop", stop, "a string, a token id, or a list of them")
    for s in items:
        if not ((isinstance(s, str) and s) or (is_int(s) and s >= 0)):
            _CHECK.fail("stop", s, "non-empty strings or non-negative token ids")
        if isinstance(s, str) and text_problem(s):
            _CHECK.fail("stop", s, text_problem(s))
    return tuple(items)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """{token id (int or decimal string): bias} or (id, bias) pairs -> sorted unique pairs."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    if not isinstance(pairs, (list, tuple)) and not isinstance(bias, dict):
        _CHECK.fail("logit_bias", bias, "an object {token id: bias}")
    out = {}
    for item in pairs:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            _CHECK.fail("logit_bias", bias, "an object {token id: bias}")
        tid, val = item
        if isinstance(tid, str) and tid.isascii() and tid.isdigit() and len(tid) <= 20:  # ("²".isdigit(); int()
            tid = int(tid)  # refuses it, and past 4300 digits any)
        if not is_int(tid) or tid < 0 or tid in out:
            _CHECK.fail("logit_bias", {str(tid): val}, "unique non-negative token ids as keys")
        if not is_number(val) or not -100 <= val <= 100:
            _CHECK.fail("logit_bias", {str(tid): val}, "biases in [-100, 100]")
        out[tid] = float(val)
    if len(out) > LOGIT_BIAS_CAPACITY:
        _CHECK.fail("logit_bias", f"{len(out)} entries", f"at most {LOGIT_BIAS_CAPACITY} entries")
    return tuple(sorted(out.items()))
