"""OpenAI completions / chat-completions shapes <-> native requests and results: the one
translator that `trtgraph run` (OpenAI batch files) and `trtgraph serve` share, so each field
is parsed and named in one place.

Requests: `completion_request(body, request_id)` and `chat_request(body, request_id)` turn an
OpenAI body into a native request dict (the JSONL fields; chat bodies keep their `messages`,
rendered with the checkpoint's template at admission). Only the shape is checked here: an
unknown field, a wrong container, an OpenAI-only rule. The values are then checked by the
native validation (`runtime.serving.requests.parse_request`), which names the same fields.
`allow_stream=True` (the server) accepts `stream` / `stream_options`; `stream_mode(body)`
reads them. An omitted `temperature` is given later, as vLLM's OpenAI server gives it, by
`model_temperature` (generation_config's, else OpenAI's 1). The native sampling fields `top_k`, `min_p`,
`repetition_penalty`, `min_tokens` and `ignore_eos` are accepted as extensions (vLLM's extra
sampling parameters; the `openai` client sends them in `extra_body`).

Responses: `Response(chat, model)` makes the bodies of one response: `full(result)` the
`text_completion` / `chat.completion` object of a native Result (one completion, or `n` of
them in `result.choices`) with `usage`; `chunk(...)` / `usage_chunk(...)` its stream chunks
(each one completion's delta, naming it by `index`, with its tokens' logprobs when asked).
`completion_object` / `chat_completion_object` are the same for one call. Every choice also
carries `token_ids` (the generated ids; in a chunk, the new ones), an extension as vLLM's
`return_token_ids`. Per-token logprobs are read from `result.logprobs`, when present, in this
intermediate shape (one entry per generated token):
    {"token_id": int, "logprob": float, "top_logprobs": [{"token_id": int, "logprob": float}, ...]}
`token_text(token_id) -> str` gives the text OpenAI shows for a token (default: the entry's
`token`, as the engine writes it).

Errors: `error_object(...)` / `error_from_exception(exc)` / `error_from_result(result)` give
`{"error": {message, type, param, code}}`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import replace
from typing import Callable

from ..errors import PromptError
from ..inputs import is_int, short, text_problem
from ..limits import MAX_LOGPROBS
from ..runtime.serving.requests import CHAT_ROLES
from ..runtime.serving.sampling_params import MAX_TOKENS_CAP, TO_CONTEXT

DEFAULT_TEMPERATURE = 1.0  # OpenAI's, where generation_config gives none (`model_temperature`)
# Native sampling fields accepted as extensions, passed on unchanged.
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos")
_SHARED = ("model", "user", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "stop", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", *EXTENSIONS)
# Completions fields accepted only at OpenAI's default (a client may send them unasked).
DEFAULT_ONLY = {"best_of": 1, "echo": False, "suffix": None}
COMPLETION_FIELDS = ("prompt", *_SHARED, *DEFAULT_ONLY)
CHAT_FIELDS = ("messages", "max_completion_tokens", "top_logprobs", *_SHARED)
# Chat fields not implemented, accepted where they ask for nothing: null (OpenAI's "not given")
# or one of these values (clients that spell out every field send them); otherwise refused.
UNUSED_CHAT = {"tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
               "response_format": ({"type": "text"},), "parallel_tool_calls": (True, False), "store": (False,),
               "metadata": (), "service_tier": ("auto", "default"), "modalities": (["text"],), "audio": (),
               "prediction": (), "reasoning_effort": (), "web_search_options": ()}
# Copied to the native request unchanged when given (and not null).
_PASSED = ("n", "max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
           "logit_bias", *EXTENSIONS)
_MESSAGE_FIELDS = ("role", "content")
# OpenAI's `developer` messages replace `system` ones for its newer models: rendered as `system`.
ROLE_ALIASES = {"developer": "system"}
_FINISH_OF = {"stop": "stop", "length": "length"}  # native finish_reason -> OpenAI's
TokenText = Callable[[int], str]
TokenBytes = Callable[[int], "bytes | None"]  # a token's own bytes (tokenizer.token_bytes), None: its text's UTF-8


class OpenAIRequestError(PromptError):
    """An OpenAI body the translation refuses; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---- requests ------------------------------------------------------------------------------

def completion_request(body, request_id: str, where: str = "request", allow_stream: bool = False) -> dict:
    """A `/v1/completions` body -> a native request dict with id `request_id`."""
    _check_fields(body, COMPLETION_FIELDS, where, "/v1/completions", allow_stream)
    for name, default in DEFAULT_ONLY.items():  # null is OpenAI's "not given", as for every other field
        if body.get(name) is not None and body[name] != default:
            raise OpenAIRequestError(f"{where}: `{name}` = {short(body[name])} is not supported; leave it out "
                                     f"(or {json.dumps(default)}).", name)
    native = {"id": request_id, **_prompt(body.get("prompt"), where), **_sampling(body)}
    _check_max_tokens(body, where)
    if body.get("logprobs") is not None:
        native["logprobs"] = body["logprobs"]
    return native


def chat_request(body, request_id: str, where: str = "request", allow_stream: bool = False) -> dict:
    """A `/v1/chat/completions` body -> a native request dict with `messages`. A body without
    `max_tokens` / `max_completion_tokens` may run to the end of the context (OpenAI's and vLLM's
    default for chat): native max_tokens "context", which admission resolves once the prompt is
    encoded."""
    _check_fields(body, CHAT_FIELDS, where, "/v1/chat/completions", allow_stream, UNUSED_CHAT)
    native = {"id": request_id, "messages": _messages(body.get("messages"), where), **_sampling(body)}
    _check_max_tokens(body, where)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        native["max_tokens"] = TO_CONTEXT
    mct = body.get("max_completion_tokens")
    if mct is not None:
        if body.get("max_tokens") is not None and body["max_tokens"] != mct:
            raise OpenAIRequestError(f"{where}: `max_tokens` ({short(body['max_tokens'])}) and `max_completion_tokens` "
                                     f"({mct}) differ; give one of them.", "max_completion_tokens")
        native["max_tokens"] = mct
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise OpenAIRequestError(f"{where}: `logprobs` = {short(logprobs)} must be true or false in a chat request; "
                                 f"ask for alternatives with `top_logprobs`.", "logprobs")
    if top is not None and not (is_int(top) and 0 <= top <= MAX_LOGPROBS):  # the native check says `logprobs`
        raise OpenAIRequestError(f"{where}: field `top_logprobs` = {short(top)} is not allowed; expected an "
                                 f"integer in [0, {MAX_LOGPROBS}] (alternatives per token).", "top_logprobs")
    if top is not None and not logprobs:
        raise OpenAIRequestError(f"{where}: `top_logprobs` needs `logprobs: true`.", "top_logprobs")
    if logprobs:
        native["logprobs"] = 0 if top is None else top
    return native


def _check_max_tokens(body: dict, where: str) -> None:
    """OpenAI's max_tokens / max_completion_tokens: integers (the native "context" is not OpenAI's);
    named here, where the native check would say `max_tokens` for either."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not is_int(value) or not 1 <= value <= MAX_TOKENS_CAP):
            raise OpenAIRequestError(f"{where}: field `{name}` = {short(value)} is not allowed; expected an "
                                     f"integer in [1, {MAX_TOKENS_CAP}].", name)


def _check_fields(body, valid: tuple[str, ...], where: str, url: str, allow_stream: bool,
                  unused: dict | None = None) -> None:
    if not isinstance(body, dict):
        raise OpenAIRequestError(f"{where}: the body of a {url} request must be a JSON object.")
    unknown = sorted(_name(k) for k in body if k not in valid and not _asks_nothing(k, body[k], unused or {}))
    if unknown:
        raise OpenAIRequestError(f"{where}: unsupported field{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(unknown)} for {url}; supported: {', '.join(valid)}.", unknown[0])
    if not allow_stream:
        for name in ("stream", "stream_options"):
            if body.get(name):
                raise OpenAIRequestError(f"{where}: `{name}` is not supported here; leave it out.", name)
        return
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise OpenAIRequestError(f"{where}: `stream` = {short(stream)} must be true or false.", "stream")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise OpenAIRequestError(f"{where}: `stream_options` = {short(options)} may only hold `include_usage` "
                                     f"(true or false).", "stream_options")
        if not stream:
            raise OpenAIRequestError(f"{where}: `stream_options` needs `stream: true`.", "stream_options")


def _asks_nothing(name: str, value, unused: dict) -> bool:
    """An unimplemented field, null or a value asking nothing (UNUSED_CHAT; `store: 0` is not `false`)."""
    return name in unused and (value is None or any(type(value) is type(v) and value == v for v in unused[name]))


def _name(key: str) -> str:
    """A field name as messages and `param` show it: a lone surrogate escaped, a long name cut short."""
    return short(key) if len(key) > 60 or text_problem(key) else key


def stream_mode(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) of a body that passed the request translation."""
    return bool(body.get("stream")), bool((body.get("stream_options") or {}).get("include_usage"))


def _sampling(body: dict) -> dict:
    return {k: body[k] for k in _PASSED if body.get(k) is not None}


def model_temperature(req, generation):
    """A translated Request's omitted temperature as vLLM's OpenAI server sets it: generation_config's
    (do_sample aside), else OpenAI's 1 (omitted top_p / top_k: generation_config's at admission)."""
    t = generation.temperature
    return req if req.sampling.temperature is not None else \
        req.with_sampling(replace(req.sampling, temperature=DEFAULT_TEMPERATURE if t is None else t))


def _prompt(prompt, where: str) -> dict:
    """OpenAI's `prompt`: text, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise OpenAIRequestError(f"{where}: `prompt` holds {len(prompt)} prompts; send one prompt per request "
                                 f"(one line per prompt in a batch file).", "prompt")
    raise OpenAIRequestError(f"{where}: `prompt` must be a string or a non-empty list of token ids.", "prompt")


def _messages(messages, where: str) -> list[dict]:
    """Validate the shape of `messages`; content parts of type text are joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects.",
                                 "messages")
    out = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise OpenAIRequestError(f"{where}: `{name}` must be an object with `role` and `content`.", name)
        extra = sorted(_name(k) for k in m if k not in _MESSAGE_FIELDS)  # e.g. `name`: the template would not see it
        if extra:
            raise OpenAIRequestError(f"{where}: `{name}` has unsupported field(s) {', '.join(extra)}; "
                                     f"supported: {', '.join(_MESSAGE_FIELDS)}.", f"{name}.{extra[0]}")
        role = ROLE_ALIASES.get(m.get("role"), m.get("role")) if isinstance(m.get("role"), str) else m.get("role")
        if role not in CHAT_ROLES:
            raise OpenAIRequestError(f"{where}: `{name}.role` = {short(m.get('role'))}; expected one of "
                                     f"{', '.join((*CHAT_ROLES, *ROLE_ALIASES))}.", f"{name}.role")
        out.append({"role": role, "content": _content(m.get("content"), where, f"{name}.content")})
    return out


def _content(content, where: str, name: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise OpenAIRequestError(f"{where}: `{name}` must be a string or a list of {{\"type\": \"text\", \"text\": ...}} "
                             f"parts (only text is supported).", name)


# ---- responses -----------------------------------------------------------------------------

class Response:
    """The bodies of one response (completion or chat), sharing its id, model and time."""

    def __init__(self, chat: bool, model: str, response_id: str | None = None, created: int | None = None,
                 token_text: TokenText | None = None, token_bytes: TokenBytes | None = None):
        self.chat, self.model = chat, model
        self.id = response_id or new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time()) if created is None else created
        self._token_text, self._token_bytes = token_text, token_bytes
        self._started: set[int] = set()  # completions a chunk was made for (a chat's first says the role)
        self._offsets: dict[int, int] = {}  # completion -> characters of its tokens' texts in chunks so far

    def _head(self, chunk: bool = False) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, result) -> dict:
        """The `text_completion` / `chat.completion` object of a finished native Result."""
        choices = []
        for i, c in enumerate(_choices(result)):
            choice = {"index": i, "finish_reason": _finish(c), "token_ids": list(c.token_ids)}
            if self.chat:
                choice.update(message={"role": "assistant", "content": c.text},
                              logprobs=_chat_logprobs(_entries(c), self._token_text, self._token_bytes))
            else:
                choice.update(text=c.text, logprobs=_completion_logprobs(_entries(c), self._token_text))
            choices.append(choice)
        return {**self._head(), "choices": choices, "usage": usage(result)}

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None = None, index: int = 0,
              logprobs: list[dict] | None = None, include_usage: bool = False) -> dict:
        """One stream chunk carrying completion `index`'s delta (`finish_reason` on its last; in
        a chat, its first also says the role). logprobs: the entries of the delta's tokens, when
        asked (an empty list for a delta of none); a completion's `text_offset` goes on from its
        previous chunks, so the chunks' lists joined are the whole answer's."""
        choice = {"index": index, "logprobs": None, "finish_reason": finish_reason and _FINISH_OF[finish_reason],
                  "token_ids": list(token_ids)}
        if self.chat:
            choice["delta"] = {"content": text} if index in self._started else {"role": "assistant", "content": text}
            if logprobs is not None:
                choice["logprobs"] = _chat_logprobs(logprobs, self._token_text, self._token_bytes)
        else:
            choice["text"] = text
            if logprobs is not None:
                choice["logprobs"] = _completion_logprobs(logprobs, self._token_text, self._offsets.get(index, 0))
                self._offsets[index] = self._offsets.get(index, 0) + sum(map(len, choice["logprobs"]["tokens"]))
        self._started.add(index)
        body = {**self._head(chunk=True), "choices": [choice]}
        if include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked for
        return body

    def usage_chunk(self, result) -> dict:
        """The last chunk when `stream_options.include_usage`: no choices, the usage."""
        return {**self._head(chunk=True), "choices": [], "usage": usage(result)}


def completion_object(result, model: str, created: int | None = None, response_id: str | None = None,
                      token_text: TokenText | None = None, token_bytes: TokenBytes | None = None) -> dict:
    """A native Result -> an OpenAI `text_completion` object."""
    return Response(False, model, response_id, created, token_text, token_bytes).full(result)


def chat_completion_object(result, model: str, created: int | None = None, response_id: str | None = None,
                           token_text: TokenText | None = None, token_bytes: TokenBytes | None = None) -> dict:
    """A native Result -> an OpenAI `chat.completion` object."""
    return Response(True, model, response_id, created, token_text, token_bytes).full(result)


def usage(result) -> dict:
    completion = sum(len(c.token_ids) for c in _choices(result))
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _choices(result) -> list:
    """The n completions of a Result (`result.choices`), or the Result itself when n == 1."""
    return list(getattr(result, "choices", None) or [result])


def _finish(choice) -> str:
    try:
        return _FINISH_OF[choice.finish_reason]
    except KeyError:
        raise ValueError(f"finish_reason {choice.finish_reason!r} has no OpenAI equivalent; "
                         f"an error result becomes an error object (error_from_result)") from None


def _text_of(entry: dict, token_text: TokenText | None) -> str:
    """The text OpenAI shows for a logprobs entry's token."""
    if token_text is not None:
        return token_text(entry["token_id"])
    return entry.get("token", f"token_id:{entry['token_id']}")


def _entries(choice) -> list[dict] | None:
    """A choice's logprob entries, None where none were asked."""
    return getattr(choice, "logprobs", None)


def _completion_logprobs(entries: list[dict] | None, token_text: TokenText | None, start: int = 0) -> dict | None:
    """Completions' logprobs of `entries`; `text_offset` counted from `start` (a stream's
    earlier chunks' tokens)."""
    if entries is None:
        return None
    tokens = [_text_of(e, token_text) for e in entries]
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_text_of(a, token_text): a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _chat_logprobs(entries: list[dict] | None, token_text: TokenText | None,
                   token_bytes: TokenBytes | None = None) -> dict | None:
    if entries is None:
        return None

    def one(entry: dict) -> dict:
        """`bytes`: the token's own (a token that is part of a character decodes alone to U+FFFD,
        whose UTF-8 is not what it stands for), else its text's UTF-8."""
        text = _text_of(entry, token_text)
        raw = None if token_bytes is None else token_bytes(entry["token_id"])
        return {"token": text, "logprob": entry["logprob"], "bytes": list(text.encode("utf-8") if raw is None else raw)}

    return {"content": [{**one(e), "top_logprobs": [one(a) for a in e["top_logprobs"]]} for e in entries],
            "refusal": None}


# ---- errors --------------------------------------------------------------------------------

def error_object(message: str, param: str | None = None, error_type: str = "invalid_request_error",
                 code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_from_exception(exc: Exception) -> dict:
    """A refused request (OpenAIRequestError, or a native PromptError naming a field `x`)."""
    param = getattr(exc, "param", None)
    if param is None:
        m = re.search(r"field `([^`]+)`", str(exc))
        param = m.group(1) if m else None
    return error_object(str(exc), param)


def body_fields(body: dict, chat: bool) -> tuple[str, str]:
    """A body's prompt field and its max field, as a refusal by the context names them."""
    given = chat and body.get("max_completion_tokens") is not None
    return "messages" if chat else "prompt", "max_completion_tokens" if given else "max_tokens"


def error_from_result(result, name_request: bool = True, fields: tuple[str, str] = ("prompt", "max_tokens")) -> dict:
    """A Result refused at admission: `run`'s message (prefixed with the request's id unless not
    `name_request`); a refusal by the context gets OpenAI's `context_length_exceeded` and names the
    body's field (`fields`: its prompt's and max's names): the prompt where it alone leaves no room."""
    message = f"request {result.id}: {result.error}" if name_request else result.error
    param = {"prompt": fields[0], "max_tokens": fields[1]}.get(result.error_param, result.error_param)
    return error_object(message, param, code=result.error_code)
