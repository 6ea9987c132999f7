"""OpenAI shapes at the edge: request bodies in (validated into the JSONL request fields,
then through the same `parse_request` as `run`), completion / chat.completion objects and
their stream chunks out, and OpenAI's error JSON.

Each choice also carries `token_ids` (the generated ids; a delta in stream chunks), an
extension as vLLM's `return_token_ids`, so clients can check tokens, not only text.
"""

from __future__ import annotations

import re
import time
import uuid

from ..errors import PromptError
from ..inputs import is_int
from ..runtime.serving.requests import Request, Result, parse_request

# Fields this edge consumes itself; every other field goes to the request validator, which
# refuses what it does not know, naming the field.
EDGE_FIELDS = ("model", "stream", "stream_options", "n", "user")
UNSUPPORTED = {"echo": False, "best_of": 1, "suffix": None}  # accepted only at these values


class OpenAIError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, error_type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def from_prompt_error(exc: PromptError) -> OpenAIError:
    """A validator's message as a 400, with `param` the field it names."""
    msg = str(exc)
    m = re.search(r"field `([^`]+)`", msg) or re.search(r"unknown fields? ([A-Za-z_0-9]+)", msg) \
        or re.search(r"`(prompt|prompt_token_ids|messages)`", msg)
    return bad_request(msg, m.group(1) if m else None)


def completion_request(body, request_id: str, vocab_size: int) -> tuple[Request, dict]:
    """A /v1/completions body as a validated Request, and the edge options (stream, usage)."""
    fields, edge = _split(body)
    prompt = fields.pop("prompt", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        fields["prompt_token_ids"] = prompt
    else:
        raise bad_request("`prompt` must be a string or a list of token ids (one prompt per request).", "prompt")
    return _validated(fields, request_id, vocab_size), edge


def chat_request(body, request_id: str, vocab_size: int) -> tuple[Request, dict]:
    """A /v1/chat/completions body as a validated Request (its `messages` are rendered with
    the checkpoint's chat template at admission), and the edge options."""
    fields, edge = _split(body)
    if "max_completion_tokens" in fields:
        if "max_tokens" in fields:
            raise bad_request("give `max_completion_tokens` or `max_tokens`, not both.", "max_completion_tokens")
        fields["max_tokens"] = fields.pop("max_completion_tokens")
    if "messages" not in fields:
        raise bad_request("`messages` is required: a list of {role, content}.", "messages")
    return _validated(fields, request_id, vocab_size), edge


def _split(body) -> tuple[dict, dict]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object.")
    for name, allowed in UNSUPPORTED.items():
        if body.get(name, allowed) != allowed:
            raise bad_request(f"`{name}` is not supported by this server.", name)
    if body.get("n", 1) != 1:
        raise bad_request("`n` must be 1 on this server.", "n")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad_request("`stream_options` may only hold `include_usage`.", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be true or false.", "stream")
    if options is not None and not stream:
        raise bad_request("`stream_options` needs `stream: true`.", "stream_options")
    edge = {"stream": stream, "include_usage": bool((options or {}).get("include_usage", False))}
    fields = {k: v for k, v in body.items() if k not in EDGE_FIELDS and k not in UNSUPPORTED}
    return fields, edge


def _validated(fields: dict, request_id: str, vocab_size: int) -> Request:
    fields = {k: v for k, v in fields.items() if v is not None}  # OpenAI clients send nulls for defaults
    try:
        return parse_request({**fields, "id": request_id}, "request body", vocab_size)
    except PromptError as exc:
        raise from_prompt_error(exc) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(result: Result) -> dict:
    n = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n}


class Shapes:
    """The bodies of one response (completion or chat), sharing its id, model and time."""

    def __init__(self, chat: bool, model: str, response_id: str):
        self.chat, self.model, self.id = chat, model, response_id
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, result: Result) -> dict:
        """The whole response of a finished request."""
        choice = {"index": 0, "logprobs": None, "finish_reason": result.finish_reason,
                  "token_ids": list(result.token_ids)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(result)}

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None, first: bool = False,
              with_usage: bool = False) -> dict:
        """One stream chunk carrying a delta."""
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason, "token_ids": list(token_ids)}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if with_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked for
        return body

    def usage_chunk(self, result: Result) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(result)}
