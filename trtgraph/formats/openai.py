"""OpenAI completions / chat-completions bodies <-> native requests and results.

Requests: `completion_request(body, request_id)` and `chat_request(body, request_id)` turn an
OpenAI body into a native request dict (the JSONL fields; chat bodies keep their `messages`,
rendered with the checkpoint's template at admission). Only the shape is checked here: an
unknown field, a wrong container, an OpenAI-only rule. The values are then checked by the
native validation (`runtime.serving.requests.parse_request`), which names the same fields.

Responses: `completion_object(result, model)` / `chat_completion_object(result, model)` turn
a native Result (one completion, or `n` of them in `result.choices`) into a `text_completion`
/ `chat.completion` object with `usage`. Per-token logprobs are read from `result.logprobs`,
when present, in this intermediate shape (one entry per generated token):
    {"token_id": int, "logprob": float, "top_logprobs": [{"token_id": int, "logprob": float}, ...]}
`token_text(token_id) -> str` gives the text OpenAI shows for a token.

Errors: `error_object(...)` / `error_from_exception(exc)` give `{"error": {message, type, param, code}}`.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Callable

from ..errors import PromptError
from ..inputs import is_int

# OpenAI's default temperature; a native request without one is greedy.
DEFAULT_TEMPERATURE = 1.0
_SHARED = ("model", "user", "stream", "n", "max_tokens", "temperature", "top_p", "stop", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias", "logprobs")
COMPLETION_FIELDS = ("prompt", *_SHARED)
CHAT_FIELDS = ("messages", "max_completion_tokens", "top_logprobs", *_SHARED)
# Copied to the native request unchanged when given (and not null).
_PASSED = ("n", "max_tokens", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias")
_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_FIELDS = ("role", "content", "name")
_FINISH = {"stop": "stop", "length": "length"}
TokenText = Callable[[int], str]


class OpenAIRequestError(PromptError):
    """An OpenAI body the translation refuses; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---- requests ------------------------------------------------------------------------------

def completion_request(body, request_id: str, where: str = "request", allow_stream: bool = False) -> dict:
    """A `/v1/completions` body -> a native request dict with id `request_id`."""
    _check_fields(body, COMPLETION_FIELDS, where, "/v1/completions", allow_stream)
    native = {"id": request_id, **_prompt(body.get("prompt"), where), **_sampling(body)}
    if body.get("logprobs") is not None:
        native["logprobs"] = body["logprobs"]
    return native


def chat_request(body, request_id: str, where: str = "request", allow_stream: bool = False) -> dict:
    """A `/v1/chat/completions` body -> a native request dict with `messages`."""
    _check_fields(body, CHAT_FIELDS, where, "/v1/chat/completions", allow_stream)
    native = {"id": request_id, "messages": _messages(body.get("messages"), where), **_sampling(body)}
    mct = body.get("max_completion_tokens")
    if mct is not None:
        if body.get("max_tokens") is not None and body["max_tokens"] != mct:
            raise OpenAIRequestError(f"{where}: `max_tokens` ({body['max_tokens']}) and `max_completion_tokens` "
                                     f"({mct}) differ; give one of them.", "max_completion_tokens")
        native["max_tokens"] = mct
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise OpenAIRequestError(f"{where}: `logprobs` = {logprobs!r} must be true or false in a chat request; "
                                 f"ask for alternatives with `top_logprobs`.", "logprobs")
    if top is not None and not logprobs:
        raise OpenAIRequestError(f"{where}: `top_logprobs` needs `logprobs: true`.", "top_logprobs")
    if logprobs:
        native["logprobs"] = 0 if top is None else top
    return native


def _check_fields(body, valid: tuple[str, ...], where: str, url: str, allow_stream: bool) -> None:
    if not isinstance(body, dict):
        raise OpenAIRequestError(f"{where}: the body of a {url} request must be a JSON object.")
    unknown = sorted(k for k in body if k not in valid)
    if unknown:
        raise OpenAIRequestError(f"{where}: unsupported field{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(unknown)} for {url}; supported: {', '.join(valid)}.", unknown[0])
    if body.get("stream") and not allow_stream:
        raise OpenAIRequestError(f"{where}: `stream: true` is not supported here; leave it out.", "stream")


def _sampling(body: dict) -> dict:
    native = {k: body[k] for k in _PASSED if body.get(k) is not None}
    temperature = body.get("temperature")
    native["temperature"] = DEFAULT_TEMPERATURE if temperature is None else temperature
    return native


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
        extra = sorted(k for k in m if k not in _MESSAGE_FIELDS)
        if extra:
            raise OpenAIRequestError(f"{where}: `{name}` has unsupported field(s) {', '.join(extra)}; "
                                     f"supported: {', '.join(_MESSAGE_FIELDS)}.", f"{name}.{extra[0]}")
        if m.get("role") not in _ROLES:
            raise OpenAIRequestError(f"{where}: `{name}.role` = {m.get('role')!r}; expected one of "
                                     f"{', '.join(_ROLES)}.", f"{name}.role")
        out.append({"role": m["role"], "content": _content(m.get("content"), where, f"{name}.content")})
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

def completion_object(result, model: str, created: int | None = None, response_id: str | None = None,
                      token_text: TokenText | None = None) -> dict:
    """A native Result -> an OpenAI `text_completion` object."""
    choices = [{"index": i, "text": c.text, "finish_reason": _finish(c),
                "logprobs": _completion_logprobs(c, token_text or _id_text)}
               for i, c in enumerate(_choices(result))]
    return {"id": response_id or new_id("cmpl"), "object": "text_completion",
            "created": int(time.time()) if created is None else created, "model": model,
            "choices": choices, "usage": usage(result)}


def chat_completion_object(result, model: str, created: int | None = None, response_id: str | None = None,
                           token_text: TokenText | None = None) -> dict:
    """A native Result -> an OpenAI `chat.completion` object."""
    choices = [{"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": _finish(c),
                "logprobs": _chat_logprobs(c, token_text or _id_text)}
               for i, c in enumerate(_choices(result))]
    return {"id": response_id or new_id("chatcmpl"), "object": "chat.completion",
            "created": int(time.time()) if created is None else created, "model": model,
            "choices": choices, "usage": usage(result)}


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
        return _FINISH[choice.finish_reason]
    except KeyError:
        raise ValueError(f"finish_reason {choice.finish_reason!r} has no OpenAI equivalent; "
                         f"an error result becomes an error object (error_from_result)") from None


def _id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _completion_logprobs(choice, token_text: TokenText) -> dict | None:
    entries = getattr(choice, "logprobs", None)
    if entries is None:
        return None
    tokens = [token_text(e["token_id"]) for e in entries]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{token_text(a["token_id"]): a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _chat_logprobs(choice, token_text: TokenText) -> dict | None:
    entries = getattr(choice, "logprobs", None)
    if entries is None:
        return None

    def one(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e["token_id"], e["logprob"]),
                         "top_logprobs": [one(a["token_id"], a["logprob"]) for a in e["top_logprobs"]]}
                        for e in entries],
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


def error_from_result(result) -> dict:
    """A Result the engine refused at admission (finish_reason "error")."""
    return error_object(f"request {result.id}: {result.error}")
