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

import functools
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
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols", _generation_extension()])
        env.filters["tojson"] = _tojson
        bound_filters(env)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.globals["dict"] = _TemplateDict()  # (the type itself would hand out dict.update on any dict)
        env.globals["namespace"] = _TemplateNamespace
        try:
            self._template = env.from_string(source)
            # vLLM's content format: a template that loops over a message's content takes OpenAI's list of
            # parts; any other is written for text, and gets a list of text parts joined (as `serve` joins them)
            self.takes_parts = _loops_over_content(env.parse(source))
        except jinja2.TemplateError as exc:
            raise WeightLoadError(f"{where}: the chat template does not compile ({exc}).") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               continue_final_message: bool = False, **kwargs) -> str:
        """The prompt text; tokenize it without adding special tokens (the template has them).
        As transformers' apply_chat_template: the template sees a copy of the messages (less their keys
        whose value is None; content parts all text joined where the template does not loop over
        content, as vLLM detects it), `tools` and `kwargs` (plain JSON data: a template cannot change
        the caller's), `kwargs` over the special tokens; `continue_final_message` ends the text where
        the last message's content ends (no end-of-turn after it), for the model to continue it."""
        import jinja2

        from .chat_bounds import RenderLimit, render_bounded

        reserved = sorted(RESERVED_NAMES & set(kwargs))
        if reserved:
            raise PromptError(f"chat template variables {', '.join(reserved)} are set by the chat itself; rename them.")
        messages = [_reasoning_aliased(_without_nones(m)) for m in plain_data(messages)]
        if not self.takes_parts:
            messages = [_text_joined(m) for m in messages]
        tools, kwargs = plain_data(tools), plain_data(kwargs)
        final = _tag_final_message(messages) if continue_final_message else None
        try:
            text = render_bounded(self._template, **{**self.tokens, "documents": None, **kwargs, "messages": messages,
                                                     "tools": tools, "add_generation_prompt": add_generation_prompt})
        except RenderLimit as exc:  # a template that loops or grows without end, or messages too many for it
            raise PromptError(f"the chat template of {self.where} went past a render bound on these messages: "
                              f"{exc}") from None
        except jinja2.TemplateError as exc:  # raise_exception() in the template, or a sandbox refusal
            raise PromptError(f"the chat template of {self.where} refused these messages: {exc}") from None
        except Exception as exc:  # the template's own code failed on these messages (a ZeroDivisionError, a
            # TypeError, a RecursionError): their refusal, not the server's or the run's end
            raise PromptError(f"the chat template of {self.where} failed on these messages: "
                              f"{type(exc).__name__}: {exc}") from None
        return text if final is None else _cut_at_tag(text, final, self.where)


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
        named = {t.get("name"): t.get("template") for t in raw
                 if isinstance(t, dict) and isinstance(t.get("name"), str)}
        if "default" not in named:
            raise WeightLoadError(f"{where}: chat_template lists templates {sorted(map(str, named))} but none named "
                                  f"'default'; trtgraph renders the default one.")
        raw = named["default"]
    if not isinstance(raw, str):
        raise WeightLoadError(f"{where}: chat_template = {str(raw)[:60]!r}; expected a Jinja template string.")
    return ChatTemplate(raw, where, tokens)


TEMPLATE_DIR = "additional_chat_templates"  # transformers 5's named templates beside chat_template.jinja


def named_templates(ckpt: Path | None) -> dict[str, tuple[str, str]]:
    """The checkpoint's templates by name, {name: (source, where)}, as transformers finds them:
    chat_template.jinja ("default") and additional_chat_templates/NAME.jinja where there are such
    files, else tokenizer_config.json's list of {name, template}. LLM.chat picks `tool_use` for a
    call with tools, or the one its `chat_template` names."""
    if ckpt is None:
        return {}
    files = sorted((ckpt / TEMPLATE_DIR).glob("*.jinja")) if (ckpt / TEMPLATE_DIR).is_dir() else []
    if files or (ckpt / TEMPLATE_FILE).is_file():
        out = {}
        for path in ([ckpt / TEMPLATE_FILE] if (ckpt / TEMPLATE_FILE).is_file() else []) + files:
            name = "default" if path.name == TEMPLATE_FILE and path.parent == ckpt else path.name[:-len(".jinja")]
            try:
                out[name] = (path.read_text(encoding="utf-8"), str(path))
            except UnicodeDecodeError as exc:
                raise WeightLoadError(f"{path}: not UTF-8 ({exc}).") from None
        return out
    raw, where = read_tokenizer_config(ckpt).get("chat_template"), str(ckpt / "tokenizer_config.json")
    if isinstance(raw, str):
        return {"default": (raw, where)}
    return {t["name"]: (t["template"], f"{where} (template {t['name']!r})") for t in raw or ()
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}


def _loops_over_content(ast) -> bool:
    """Whether a parsed template has a `for` over some `x['content']` / `x.content` (filters aside)."""
    import jinja2.nodes as nodes

    for loop in ast.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, (nodes.Filter, nodes.Test)) and it.node is not None:
            it = it.node
        if (isinstance(it, nodes.Getattr) and it.attr == "content") or (
                isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content"):
            return True
    return False


def _text_joined(message):
    """A message whose content is a list of text parts only, with that text as its content."""
    parts = message.get("content") if isinstance(message, dict) else None
    if not (isinstance(parts, list) and parts and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts)):
        return message
    return {**message, "content": "".join(p["text"] for p in parts)}


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; HF templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=1)
def _generation_extension():
    """`{% generation %}...{% endgeneration %}`: transformers' mark of the assistant's tokens (for
    training masks); rendering, it writes its body as is."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


class _TemplateDict:
    """`dict` in a template, as transformers gives it: dict(...) and dict.fromkeys(...), nothing else."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_name(name) -> None:
    import jinja2

    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template cannot store the underscore-prefixed attribute "
                                              f"{name!r} on a namespace")


def _make_namespace_class():
    import jinja2.utils

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja2's namespace() without underscore-prefixed attributes (as transformers)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _namespace_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _namespace_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


_TemplateNamespace = _make_namespace_class()


MAX_DEPTH = 64  # nesting of the data a template is given (JSON's own readers stop there too)


def plain_data(value, depth: int = 0):
    """A copy of `value` made of JSON's types only (str, int, float, bool, None, dict, list; a tuple
    as a list): what a template may see of the caller's data. A numpy number is the Python one;
    anything else, or data nested past MAX_DEPTH (or holding itself), is refused by TypeError."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if depth >= MAX_DEPTH and isinstance(value, (dict, list, tuple)):
        raise TypeError(f"nested deeper than {MAX_DEPTH} levels (or holding itself)")
    if isinstance(value, dict):
        return {plain_data(k, depth + 1): plain_data(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v, depth + 1) for v in value]
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    for kind in (bool, int, float, str):  # subclasses (an IntEnum, a str subclass) as the plain type
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    raise TypeError(f"{type(value).__name__} is not plain JSON data")


RESERVED_NAMES = frozenset({"messages", "tools", "add_generation_prompt"})  # (`documents` may be given)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _without_nones(message):
    """A message without its keys whose value is None, as transformers' apply_chat_template drops
    them before rendering (the OpenAI SDK's messages carry `tool_calls: None`, `name: None`; a
    template tests `is defined` or `in message`)."""
    return {k: v for k, v in message.items() if v is not None} if isinstance(message, dict) else message


def _reasoning_aliased(message):
    """A message's reasoning under each name templates read it by (transformers' aliasing)."""
    if not isinstance(message, dict):
        return message
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list) -> str:
    """The last message's content (its last text part) marked with CONTINUE_TAG, as transformers
    marks it; the content before the mark is returned."""
    last = messages[-1] if messages else None
    content = last.get("content") if isinstance(last, dict) else None
    if isinstance(content, str):
        last["content"] = content + CONTINUE_TAG
        return content
    for part in reversed(content if isinstance(content, list) else []):
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            text, part["text"] = part["text"], part["text"] + CONTINUE_TAG
            return text
    raise PromptError("continue_final_message: the last message has no text content to continue.")


def _cut_at_tag(text: str, final: str, where: str) -> str:
    """The render up to where the final message's text ends (transformers' cut)."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise PromptError(f"continue_final_message: the chat template of {where} does not write the last message's "
                          f"content as given, so its end cannot be found to continue it.")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
