"""Chat templates: a checkpoint's Jinja template rendered as Hugging Face renders it.

The template comes from `chat_template.jinja` beside tokenizer_config.json (which wins,
as in transformers), or the `chat_template` field of tokenizer_config.json: a string, or a
list of {name, template} of which `default` is used. It renders in jinja2's immutable
sandbox with what HF templates expect: trim_blocks and lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, the special
tokens as strings (`bos_token`, `eos_token`, ...) and `add_generation_prompt`. A template
is code from the checkpoint: the sandbox keeps it from reaching anything else, and
chat_bounds from running or growing without end.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ..errors import PromptError, WeightLoadError
from .jsonfiles import read_json, read_json_object

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_tokenizer_config(ckpt: Path) -> dict:
    """tokenizer_config.json as a dict ({} when there is none)."""
    path = ckpt / "tokenizer_config.json"
    if not path.is_file():
        return {}
    return read_json_object(path)


def special_tokens(tok_config: dict, ckpt: Path | None = None) -> dict[str, str]:
    """bos_token, eos_token, ... as strings: tokenizer_config.json, then special_tokens_map.json."""
    extra = {}
    if ckpt is not None and (ckpt / "special_tokens_map.json").is_file():
        extra = read_json(ckpt / "special_tokens_map.json")
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        val = tok_config.get(key, extra.get(key) if isinstance(extra, dict) else None)
        if isinstance(val, dict):  # an AddedToken: {"content": "<s>", ...}
            val = val.get("content")
        if isinstance(val, str):
            out[key] = val
    return out


class ChatTemplate:
    """One compiled template plus the special-token strings it may use."""

    def __init__(self, source: str, where: str, tokens: dict[str, str]):
        import jinja2

        from .chat_bounds import BoundedSandbox, bound_filters

        self.source, self.where, self.tokens = source, where, tokens
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        bound_filters(env)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise WeightLoadError(f"{where}: the chat template does not compile ({exc}).") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text; tokenize it without adding special tokens (the template has them)."""
        import jinja2

        from .chat_bounds import RenderLimit, render_bounded

        try:
            return render_bounded(self._template, messages=messages, tools=None, documents=None,
                                  add_generation_prompt=add_generation_prompt, **self.tokens)
        except RenderLimit as exc:  # a template that loops or grows without end, or messages too many for it
            raise PromptError(f"the chat template of {self.where} went past a render bound on these messages: "
                              f"{exc}") from None
        except jinja2.TemplateError as exc:  # raise_exception() in the template, or a sandbox refusal
            raise PromptError(f"the chat template of {self.where} refused these messages: {exc}") from None
        except Exception as exc:  # the template's own code failed on these messages (a ZeroDivisionError, a
            # TypeError, a RecursionError): their refusal, not the server's or the run's end
            raise PromptError(f"the chat template of {self.where} failed on these messages: "
                              f"{type(exc).__name__}: {exc}") from None


def load_chat_template(ckpt: Path | None) -> ChatTemplate | None:
    """The checkpoint's chat template, or None when it has none."""
    if ckpt is None:
        return None
    tok_config = read_tokenizer_config(ckpt)
    tokens = special_tokens(tok_config, ckpt)
    jinja_file = ckpt / TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return ChatTemplate(jinja_file.read_text(encoding="utf-8"), str(jinja_file), tokens)
        except UnicodeDecodeError as exc:
            raise WeightLoadError(f"{jinja_file}: not UTF-8 ({exc}).") from None
    raw = tok_config.get("chat_template")
    where = str(ckpt / "tokenizer_config.json")
    if raw is None:
        return None
    if isinstance(raw, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict) and isinstance(t.get("name"), str)}
        if "default" not in named:
            raise WeightLoadError(f"{where}: chat_template lists templates {sorted(map(str, named))} but none named "
                                  f"'default'; trtgraph renders the default one.")
        raw = named["default"]
    if not isinstance(raw, str):
        raise WeightLoadError(f"{where}: chat_template = {str(raw)[:60]!r}; expected a Jinja template string.")
    return ChatTemplate(raw, where, tokens)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; HF templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)
