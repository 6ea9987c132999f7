"""The Python API: prompts in, typed completions out, on one engine.

    import trtgraph
    llm = trtgraph.LLM("trtgraph-artifacts")
    for c in llm.generate(["Hello", "The capital of France is"], {"max_tokens": 8}):
        print(c.id, c.text, c.finish_reason)

Prompts are a string, a list of token ids, a request dict with the JSONL fields (`id`
optional), or a list of those. `sampling` (a SamplingParams or a dict of the JSONL sampling
fields) applies to every prompt; a dict prompt's own fields win. Every request goes through
the JSONL validator. Several `generate` / `stream` / `chat` calls may be live at once (a
stream consumed alternately with another, a generate in between, on several threads): they share one scheduler
and each gets exactly the tokens it would get alone.

`llm.close()` (or the end of `with trtgraph.LLM(...) as llm:`) gives back the engine's graphs,
KV cache and weights; every call after it raises EngineClosedError.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from ...errors import PromptError
from .deliveries import BY_CHOICE
from .engine import Engine, EngineClosedError
from .llm_chat import ChatOptions, check_conversation, conversations_of, is_plain
from .requests import Request, Result, parse_request
from .sampling_params import with_stop_token_ids
from .streaming import RequestOutput


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    ttft_ms: float | None  # arrival to first token
    tpot_ms: float | None  # mean time per output token after the first


@dataclass(frozen=True)
class Completion:
    """One finished request. `to_json()` is its line in `trtgraph run`'s output, less
    `request_sha256` (the fingerprint of the request's line in a prompts file, which only `run` reads)."""
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | error
    usage: Usage
    timings: Timings
    error: str | None = None
    logprobs: list | None = None
    choices: list["Completion"] | None = None  # n > 1: the n completions in index order (usage counts them all)
    _result: Result = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, r: Result) -> "Completion":
        choices = None if r.choices is None else [cls.of(c) for c in r.choices]
        generated = len(r.token_ids) if choices is None else sum(len(c.token_ids) for c in choices)
        return cls(id=r.id, text=r.text, token_ids=list(r.token_ids), finish_reason=r.finish_reason,
                   usage=Usage(r.prompt_tokens, generated), timings=Timings(r.ttft_ms, r.tpot_ms),
                   error=r.error, logprobs=getattr(r, "logprobs", None), choices=choices, _result=r)

    def to_json(self) -> dict:
        return self._result.to_json()


@dataclass(frozen=True)
class CompletionDelta:
    """What one engine step added to a request: new token ids and new text (never part of a
    character, never the start of a stop string), and at the end the whole Completion. A request
    with n > 1 streams each completion's deltas, naming it by `index`; one whose completion ended
    has its `finish_reason` but not `finished` (the request's last delta, with the Completion and
    its `choices`, follows once all n have). `logprobs`: the new tokens' entries, when asked."""
    id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    completion: Completion | None
    index: int = 0
    logprobs: list | None = None

    @classmethod
    def of(cls, out: RequestOutput) -> "CompletionDelta":
        return cls(out.id, list(out.token_ids), out.text, out.finished, out.finish_reason,
                   Completion.of(out.result) if out.result is not None else None, out.index,
                   None if out.logprobs is None else list(out.logprobs))


class LLM:
    """One engine; its calls may be live at once, on one thread or several (each step holds the
    engine's lock). `close()` (or a `with` block) gives back what it holds on the device."""

    def __init__(self, manifest_path: str | Path = "trtgraph-artifacts", eager: bool = False,
                 model: str | Path | None = None, speculative: bool = True):
        """Load and check the manifest, re-record its graphs, lock. `eager=True` runs the same
        scheduler without graphs, for A/B checks. `model`: the checkpoint directory where it has
        moved since capture (checked against the manifest's file sizes and sha256).
        `speculative=False`: plain decode steps where the manifest has a speculative section
        (`run --no-speculative`), for A/B runs on the same capture."""
        _check_arguments(manifest_path, eager, model, speculative)
        self.engine = Engine(manifest_path, eager=eager, model=model, speculative=speculative)
        self._next_id = itertools.count()

    def close(self) -> None:
        """Stop for good and give back what the engine holds: its graphs are destroyed and its
        KV cache, buffers and weights dropped (on CUDA torch's allocator has their memory back at
        once; `torch.cuda.empty_cache()` returns it to the device). Requests still being served
        are dropped: a stream being read ends, a generate on another thread raises
        EngineClosedError, as does every call after this one. Idempotent; `stats` stays readable."""
        self.engine.close()

    @property
    def closed(self) -> bool:
        return self.engine.closed

    def __enter__(self) -> "LLM":
        self.engine.check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, sampling=None) -> list[Completion]:
        """Every prompt's Completion, in the order given (a PromptError if one of them was
        aborted meanwhile, by Engine.abort)."""
        reqs = self._requests(prompts, sampling)
        done: dict[str, Completion] = {}
        ids, owners = [r.id for r in reqs], {r.id: r for r in reqs}  # (the submission: Engine.owners)
        try:  # (known before it is submitted: a Ctrl-C as submit returns leaves none served for nobody)
            self.engine.submit(reqs)
            for out in self.engine.outputs_of(ids, owners):
                if out.finished:
                    done[out.id] = Completion.of(out.result)
        finally:  # interrupted (Ctrl-C): the rest must not be served for nobody
            self.engine.abort_unfinished(ids, set(done), owners)
        gone = [r.id for r in reqs if r.id not in done]
        if gone:
            raise PromptError(f"request {gone[0]!r} was aborted (Engine.abort) before it finished; "
                              f"{len(done)} of {len(reqs)} requests finished.")
        return [done[r.id] for r in reqs]

    def stream(self, prompts, sampling=None) -> Iterator[CompletionDelta]:
        """Deltas as tokens are produced, each prompt's in order, prompts interleaved; the
        last delta of each has `finished` and the Completion (with n > 1, each completion's
        deltas as they are drawn, by `index`, before it). Validated at the call; the
        requests join the engine when iteration starts. Closing the iterator early aborts
        what it had not finished."""
        return self._stream(self._requests(prompts, sampling))

    def chat(self, conversations, sampling=None, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict | None = None) -> list[Completion]:
        """One conversation (a list of {role, content}) or a list of them, rendered with the
        checkpoint's chat template (its `tool_use` one for a call with tools, where it has one; or
        `chat_template`: a template's text, its file's path or the name of one of the checkpoint's
        templates) as transformers' apply_chat_template renders it; a Completion per conversation,
        in order. As vLLM's LLM.chat: `add_generation_prompt=False` leaves out the assistant turn's
        header; `continue_final_message`
        continues the last message (with add_generation_prompt=False); `tools`: JSON schemas the
        template sees as `tools`; `chat_template_kwargs`: more variables for it (`enable_thinking`).
        Messages may carry `tool` roles, `tool_calls`, `name`, content parts: the template sees
        them. A conversation the template refuses gets a Completion with finish_reason "error"
        naming the template and its message; a bad argument raises PromptError."""
        self.engine.check_open()
        convs = conversations_of(conversations)
        options = ChatOptions(self.engine, chat_template, add_generation_prompt, continue_final_message, tools,
                              chat_template_kwargs)
        if not options.given and all(is_plain(c) for c in convs):
            return self.generate([{"messages": c} for c in convs], sampling)
        items = [self._rendered(options, check_conversation(c, f"conversations[{i}]")) for i, c in enumerate(convs)]
        good = [x for x in items if isinstance(x, dict)]
        if not good:
            self._requests([[0]], sampling)  # (the sampling fields are checked all the same)
        served = iter(self.generate(good, sampling) if good else ())
        return [next(served) if isinstance(x, dict) else self._refusal(x) for x in items]

    def _rendered(self, options: ChatOptions, conversation) -> dict | str:
        """The conversation as a request dict of token ids, or why the template or the context refuses it."""
        try:
            text = options.render(conversation)
        except PromptError as exc:
            return str(exc)
        ids, fail = self.engine.admission._encode(text, False)
        if fail:
            return str(fail)
        return {"prompt_token_ids": ids} if ids else "the chat template rendered these messages as no text"

    def _refusal(self, error: str) -> Completion:
        return Completion.of(Result(id=self._new_id(), finish_reason="error", error=error))

    def _new_id(self, given: set[str] = frozenset()) -> str:
        """A made request id: never one given in the same call (`given`) or one still live."""
        return next(rid for n in self._next_id if (rid := f"trtgraph-{n}") not in given
                    and not self.engine._is_live(rid))

    @property
    def stats(self) -> dict:
        """The summary of the engine's current run (since it was last idle): tokens/s,
        steps per key, padding waste, ..."""
        return self.engine.stats.to_json()

    def _stream(self, reqs: list[Request]) -> Iterator[CompletionDelta]:
        ids, owners, finished = [r.id for r in reqs], {r.id: r for r in reqs}, set()
        try:
            self.engine.submit(reqs, stream=BY_CHOICE)  # (closed before the stream started: EngineClosedError)
            outputs = self.engine.outputs_of(ids, owners)
            while True:
                try:
                    out = next(outputs)
                except (StopIteration, EngineClosedError):  # (closed while being read: the stream ends there)
                    return
                if out.finished:
                    finished.add(out.id)
                yield CompletionDelta.of(out)
        finally:  # closed early: the rest leaves the engine at its next step
            self.engine.abort_unfinished(ids, finished, owners)

    def _requests(self, prompts, sampling) -> list[Request]:
        """Every prompt as a validated Request (ids made for those without one)."""
        self.engine.check_open()
        defaults = _sampling_fields(sampling)
        vocab = self.engine.vocab_size
        prompts = _array_ids(prompts, (1, 2))
        if not _is_one_prompt(prompts) and (isinstance(prompts, (bytes, bytearray))
                                             or not isinstance(prompts, Iterable)):
            raise PromptError(f"prompts: expected a string, a list of token ids, a request dict or a list of those; "
                              f"got {type(prompts).__name__}.")
        if getattr(prompts, "ndim", None) == 0 and not isinstance(prompts, numbers.Number):
            raise PromptError(f"prompts: a 0-d {type(prompts).__name__} holds one value, not a prompt; pass a 1-D "
                              f"array of token ids (2-D: one prompt per row), a string or a list of those.")
        if isinstance(prompts, (set, frozenset)):
            raise PromptError(f"prompts: a set has no order, and completions come back in the prompts' order (they "
                              f"name no prompt); pass a list. Got a {type(prompts).__name__} of {len(prompts)}.")
        items = [prompts] if _is_one_prompt(prompts) else list(prompts)
        fields = [None if isinstance(item, Request) else {**defaults, **_prompt_fields(item, f"prompts[{i}]")}
                  for i, item in enumerate(items)]
        given = {str(f["id"]) for f in fields if f is not None and f.get("id") is not None}
        given |= {item.id for item in items if isinstance(item, Request)}
        reqs = []
        for i, (item, raw) in enumerate(zip(items, fields)):
            if raw is None:  # (a copy: each call's submission is its own, even of one Request object)
                reqs.append(copy.copy(item))
                continue
            if raw.get("id") is None:  # a made id is never one given in this call or one still live
                raw["id"] = self._new_id(given)
            reqs.append(parse_request(raw, f"prompts[{i}]", vocab))
        return reqs


def _check_arguments(manifest_path, eager, model, speculative) -> None:
    """LLM's arguments of a type it cannot mean (LLM(eager="no") would serve eagerly), refused by name."""
    for name, value in (("manifest_path", manifest_path), ("model", model)):
        if value is None and name == "model":
            continue
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise PromptError(f"LLM: `{name}` = {value!r} is not allowed; expected a non-empty path (a str or "
                              f"os.PathLike): the artifacts directory or its manifest.json" if name == "manifest_path"
                              else f"LLM: `{name}` = {value!r} is not allowed; expected None or the checkpoint "
                              f"directory's path (a str or os.PathLike).")
    if model is not None and (Path(model).name == "manifest.json" or (Path(model) / "manifest.json").is_file()):
        artifacts = str(Path(model).parent if Path(model).name == "manifest.json" else model)
        raise PromptError(f"LLM: `model` = {str(model)!r} holds manifest.json: it is an artifacts directory, the first "
                          f"argument: LLM({artifacts!r}). `model` is the checkpoint directory, only where it has "
                          f"moved since capture.")
    for name, value in (("eager", eager), ("speculative", speculative)):
        if not isinstance(value, bool):
            raise PromptError(f"LLM: `{name}` = {value!r} is not allowed; expected True or False.")


def _is_one_prompt(prompts) -> bool:
    return isinstance(prompts, (str, dict, Request)) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and all(_is_token(t) for t in prompts))


def _is_token(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)  # numpy integers too


def _array_ids(value, ndims: tuple[int, ...]):
    """A numpy array or torch tensor of token ids (one prompt; 2-D: one per row) as lists."""
    if not isinstance(value, (str, dict, list, tuple)) and getattr(value, "ndim", None) in ndims \
            and hasattr(value, "tolist"):
        return value.tolist()
    return value


def _prompt_fields(item, where: str) -> dict:
    item = _array_ids(item, (1,))
    if isinstance(item, str):
        return {"prompt": item}
    if isinstance(item, dict):
        return _stop_ids_joined(dict(item), where)
    if isinstance(item, (list, tuple)):
        return {"prompt_token_ids": [int(t) if _is_token(t) else t for t in item]}
    raise PromptError(f"{where}: a prompt is a string, a list of token ids or a request dict; got "
                      f"{type(item).__name__}.")


def _sampling_fields(sampling) -> dict[str, Any]:
    """The JSONL sampling fields of a SamplingParams (those not at their defaults) or a dict."""
    if sampling is None:
        return {}
    if isinstance(sampling, dict):
        fields = dict(sampling)
    elif dataclasses.is_dataclass(sampling) and not isinstance(sampling, type):
        fields = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(sampling)
                  if getattr(sampling, f.name) != f.default}
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
    else:
        raise PromptError(f"sampling: expected a SamplingParams or a dict of sampling fields; got "
                          f"{type(sampling).__name__}.")
    for name in ("id", "prompt", "prompt_token_ids", "messages"):
        if name in fields:
            raise PromptError(f"sampling: `{name}` is not a sampling field; give it with the prompt.")
    return _stop_ids_joined(fields, "sampling")


def _stop_ids_joined(fields: dict, where: str) -> dict:
    """vLLM's `stop_token_ids` joined to `stop` (the JSONL field holding both)."""
    if fields.get("stop_token_ids") is None:
        fields.pop("stop_token_ids", None)
        return fields
    try:
        fields["stop"] = list(with_stop_token_ids(fields.get("stop"), fields.pop("stop_token_ids")))
    except PromptError as exc:
        raise PromptError(f"{where}: {getattr(exc, 'detail', exc)}") from None
    return fields
