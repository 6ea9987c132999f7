"""LLM.chat's conversations and template options (vLLM's LLM.chat): `chat_template`,
`add_generation_prompt`, `continue_final_message`, `tools`, `chat_template_kwargs`.

A conversation of plain {role, content} messages with no option goes to the engine as a
`messages` request (rendered at admission, as `run` and `serve` render it). Anything else —
an option, a `tool` message, an assistant's `tool_calls`, content parts — is rendered here as
transformers' apply_chat_template renders it, then encoded without special tokens (the
template has them), and sent as token ids.
"""

from __future__ import annotations

import os

from ...errors import PromptError, WeightLoadError
from ...inputs import InputTooLarge, read_bounded, short, text_problem
from ...models.chat import RESERVED_NAMES, ChatTemplate, named_templates, plain_data
from .requests import CHAT_ROLES


def conversations_of(conversations) -> list[list]:
    """One conversation (a list of message dicts) or a list of them, as a list of them."""
    if isinstance(conversations, list) and conversations and all(isinstance(m, dict) for m in conversations):
        return [conversations]
    if not isinstance(conversations, list) or not conversations:
        raise PromptError("chat: expected a conversation (a list of {role, content}) or a list of them.")
    return conversations


def is_plain(conversation) -> bool:
    """Messages the engine's `messages` request takes as they are: exactly role and content, text."""
    return isinstance(conversation, list) and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in CHAT_ROLES
        and isinstance(m["content"], str) for m in conversation)


class ChatOptions:
    """The template options of one LLM.chat call, checked once (a bad one raises PromptError naming it)."""

    def __init__(self, engine, chat_template, add_generation_prompt, continue_final_message, tools, kwargs):
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise PromptError(f"chat: `{name}` = {short(flag)} is not allowed; expected True or False.")
        if add_generation_prompt and continue_final_message:
            raise PromptError("chat: `continue_final_message=True` continues the last message, `add_generation_prompt"
                              "=True` starts a new assistant turn after it; pass add_generation_prompt=False with it.")
        self.add_generation_prompt, self.continue_final_message = add_generation_prompt, continue_final_message
        self.tools = _data("tools", tools, list, "a list of JSON schema objects (dicts)")
        if self.tools is not None and not all(isinstance(t, dict) for t in self.tools):
            bad = next(t for t in self.tools if not isinstance(t, dict))
            raise PromptError(f"chat: `tools` holds {short(bad)}; expected JSON schema objects (dicts), one per tool.")
        self.kwargs = _data("chat_template_kwargs", kwargs, dict, "a dict of template variables") or {}
        for key in self.kwargs:
            if not isinstance(key, str) or not key.isidentifier() or key in RESERVED_NAMES:
                raise PromptError(f"chat: `chat_template_kwargs` key {short(key)} is not allowed; expected variable "
                                  f"names other than {', '.join(sorted(RESERVED_NAMES))} (set by the chat itself).")
        docs = self.kwargs.get("documents")
        if docs is not None and not (isinstance(docs, list) and all(isinstance(d, dict) for d in docs)):
            raise PromptError(f"chat: `chat_template_kwargs` documents = {short(docs)} is not allowed; expected a "
                              f"list of dicts (each with `title` and `text`, as RAG templates read them).")
        self.template = _template(engine, chat_template, self.tools)
        self.given = (chat_template is not None or not add_generation_prompt or continue_final_message
                      or tools is not None or bool(self.kwargs))

    def render(self, conversation) -> str:
        """The conversation's prompt text (PromptError: the template refused it)."""
        if self.template is None:
            raise PromptError("this model has no chat template (no `chat_template` in tokenizer_config.json and no "
                              "chat_template.jinja); pass one: llm.chat(..., chat_template=TEMPLATE_TEXT).")
        return self.template.render(conversation, add_generation_prompt=self.add_generation_prompt, tools=self.tools,
                                    continue_final_message=self.continue_final_message, **self.kwargs)


def check_conversation(conversation, where: str) -> list[dict]:
    """A conversation for the template: a non-empty list of messages, each with a `role` string
    and `content` (text, None, or a list of parts), other fields (name, tool_calls, tool_call_id,
    reasoning_content, ...) passed on; every value plain JSON data with valid text."""
    if not isinstance(conversation, list) or not conversation:
        raise PromptError(f"chat: {where} = {short(conversation)} is not allowed; expected a non-empty list of "
                          f"{{role, content}} messages.")
    for j, m in enumerate(conversation):
        at = f"{where}[{j}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise PromptError(f"chat: {at} = {short(m)} is not allowed; expected a message with a `role` string.")
        if not (m.get("content") is None or isinstance(m["content"], (str, list))):
            raise PromptError(f"chat: {at}.content = {short(m['content'])} is not allowed; expected a string, None "
                              f"or a list of content parts.")
        _data(at, m, dict, "plain JSON data")
    return conversation


def _data(name, value, kind, expected):
    """`value` (None, or of `kind`) as plain JSON data, its text valid; PromptError naming `name`."""
    if value is None:
        return None
    if not isinstance(value, kind):
        raise PromptError(f"chat: `{name}` = {short(value)} is not allowed; expected {expected}.")
    try:
        value = plain_data(value)
    except TypeError as exc:
        raise PromptError(f"chat: `{name}` holds a value that is not JSON data: {exc}.") from None
    problem = _text_problem(value)
    if problem:
        raise PromptError(f"chat: `{name}` holds text that is not allowed: {problem}.")
    return value


def _text_problem(value) -> str | None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str) and text_problem(item):
            return f"{short(item)}: {text_problem(item)}"
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


MAX_TEMPLATE_BYTES = 1 << 20  # a template file (real ones are a few KB)


def _template(engine, source, tools) -> ChatTemplate | None:
    """The template given to the call (its text, a path of a file holding it, or the name of one of
    the checkpoint's templates; compiled with the checkpoint's special tokens), else, as
    transformers picks: the checkpoint's `tool_use` template for a call with tools, its default."""
    named = named_templates(engine.admission.checkpoint_dir) if source is not None or tools is not None else {}
    where = "the chat_template given to LLM.chat"
    if source is None:
        if tools is None or "tool_use" not in named:
            return engine.chat_template
        source, where = named["tool_use"]
    elif isinstance(source, str) and source in named:
        source, where = named[source]
    elif isinstance(source, os.PathLike) or (isinstance(source, str) and "{{" not in source and "{%" not in source):
        source, where = _template_file(source), str(source)
    if not isinstance(source, str) or not source.strip() or text_problem(source):
        raise PromptError(f"chat: `chat_template` = {short(source)} is not allowed; expected the template's Jinja "
                          f"text, the path of a file holding it, or the name of one of the checkpoint's templates.")
    tokens = engine.chat_template.tokens if engine.chat_template is not None else _tokens(engine)
    try:
        return ChatTemplate(source, where, tokens)
    except WeightLoadError as exc:
        raise PromptError(f"chat: {exc}") from None


def _template_file(path) -> str:
    """A template file's text (a str with no `{{` or `{%` is taken for a path, as vLLM's loader takes it)."""
    if isinstance(path, str) and not path.strip():
        raise PromptError("chat: `chat_template` = '' is not allowed; expected the template's Jinja text or the path "
                          "of a file holding it.")
    try:
        data = read_bounded(path, MAX_TEMPLATE_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        raise PromptError(f"chat: `chat_template` = {short(str(path))} is neither a template (no {{{{ }}}} or {{% %}}) "
                          f"nor a file; give the template's text or an existing file's path.") from None
    except (OSError, InputTooLarge) as exc:
        what = "a directory" if os.path.isdir(path) else str(exc)
        raise PromptError(f"chat: `chat_template` = {short(str(path))} cannot be read as a template file ({what}).") \
            from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"chat: `chat_template` file {path}: not UTF-8 ({exc}).") from None


def _tokens(engine) -> dict[str, str]:
    from ...models.chat import read_tokenizer_config, special_tokens

    ckpt = engine.admission.checkpoint_dir
    return {} if ckpt is None else special_tokens(read_tokenizer_config(ckpt), ckpt)
