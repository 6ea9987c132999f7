"""Adversarial pass over the thirteenth session's features: the chat template's render bounds
(models/chat_bounds.py) and --resume's request fingerprints."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from trtgraph.errors import PromptError
from trtgraph.models import chat_bounds
from trtgraph.models.chat import ChatTemplate

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "hello"}]


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, "ckpt/chat_template.jinja", {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.fixture()
def small_limit(monkeypatch):
    monkeypatch.setattr(chat_bounds, "MAX_CHARS", 1000)
    monkeypatch.setattr(chat_bounds, "RENDER_SECONDS", 2.0)


def test_sum_of_lists_stops_at_the_deadline():
    """`|sum(start=[])` ran as one C call (builtins.sum): quadratic, never reaching a bytecode
    where the watchdog's exception lands; the render held its thread for hours."""
    code = textwrap.dedent("""
        from trtgraph.models import chat_bounds
        from trtgraph.models.chat import ChatTemplate
        from trtgraph.errors import PromptError
        chat_bounds.RENDER_SECONDS = 0.5
        t = ChatTemplate("{{ ([[1]] * 200000) | sum(start=[]) | length }}", "ckpt", {})
        try:
            t.render([{"role": "user", "content": "hi"}])
        except PromptError as exc:
            print("refused:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=15,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert "refused:" in proc.stdout and "render bound" in proc.stdout, proc.stdout + proc.stderr


def test_sum_of_numbers_and_strings_still_sums():
    assert template("{{ [1, 2, 3] | sum }}|{{ [{'n': 2}, {'n': 5}] | sum(attribute='n') }}|"
                    "{{ [[1], [2]] | sum(start=[]) }}").render(MESSAGES) == "6|7|[1, 2]"


@pytest.mark.parametrize("source", [
    "{% set a = 'x' * 1000 %}{{ (a ~ a ~ a) | length }}",  # `~` joined past the limit, unchecked
    "{% set a = 'x' * 1000 %}{{ a[:-1] ~ 'y' in [a] * 1000 }}",  # `in`: 1000 compares of the whole string
    "{% set a = 'x' * 1000 %}{{ ([a] * 1000).count(a[:-1] ~ 'y') }}",  # the same through a method
    "{% set a = 'x' * 1000 %}{{ a[:-1] ~ 'y' is in [a] * 1000 }}",  # the same through a test
    "{% set a = 'x' * 1000 %}{{ ([a] * 1000) | sort | length }}",  # sorting compares the whole strings
])
def test_values_past_the_limit_are_refused_where_they_are_used(source, small_limit):
    with pytest.raises(PromptError, match="render bound"):
        template(source).render(MESSAGES)


@pytest.mark.parametrize("source", [
    "{% set a = 'x' * 1000 %}{{ ([a] * 1000) | string | length }}",
    "{% set a = 'x' * 1000 %}{{ ([a] * 1000) | tojson | length }}",
    "{% set a = 'x' * 1000 %}{{ [a] * 1000 }}",
    "{% set a = 'x' * 1000 %}{% set b = [a, a] %}{% set c = [b, b, b, b] %}{% set d = [c, c, c, c] %}"
    "{% set e = [d, d, d, d] %}{{ e ~ '' }}",  # nested literals: no `*` at all
    "{% set a = 'x' * 1000 %}{{ ('%(a)s' * 190) % {'a': a} }}",
    "{% set a = 'x' * 1000 %}{{ ('%(a)s' * 190) | format(a=a) }}",
    "{% set a = 'x' * 1000 %}{{ ('{0}' * 300).format(a) }}",
])
def test_a_huge_text_of_a_value_is_refused_before_it_is_built(source, small_limit):
    """str(), repr() or JSON of a list holding one string many times is that string many times:
    it was built whole (in C, past the deadline's reach) and only then found too long."""
    compiled = template(source)
    tracemalloc.start()
    try:
        with pytest.raises(PromptError, match="render bound"):
            compiled.render(MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100_000, peak


@pytest.mark.parametrize("source", [
    "{{ messages | length }}{{ messages[0].content in ['hello', 'x'] }}{{ messages == messages }}"
    "{{ messages | tojson }}{{ messages[0] }}{{ 'a' ~ messages[0].content ~ 1 }}{{ '%s-%d' % ('a', 2) }}"
    "{{ '{}-{}'.format('a', 'b') }}{{ ('hello' is in (messages | map(attribute='content') | list)) }}"
    "{{ [[1], [2]] | sum(start=[]) }}{{ messages | sum(attribute='role', start=[]) if false }}{{ 2 < 3 < 4 }}"
    "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}{{ (messages | sort(attribute='role'))[0] }}",
])
def test_ordinary_constructs_render_as_the_plain_sandbox_renders_them(source):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from trtgraph.models.chat import _tojson
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    expected = env.from_string(source).render(messages=MESSAGES, add_generation_prompt=True)
    assert template(source).render(MESSAGES) == expected


def _render_in_thread(t: ChatTemplate, seconds: float = 10.0) -> list:
    out: list = []

    def go():
        try:
            out.append(t.render(MESSAGES))
        except PromptError as exc:
            out.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the render ran on past its deadline"
    return out


def test_the_deadline_is_not_swallowed_by_an_except_exception_on_the_way(monkeypatch):
    """The watchdog raises once; an `except Exception` in Python code the template calls (jinja2's own
    `is sequence` test holds one, around Undefined.__len__) swallowed it and the render ran on with
    no deadline left."""
    monkeypatch.setattr(chat_bounds, "RENDER_SECONDS", 0.05)

    def swallowing():  # as jinja2.tests.test_sequence: try: ... except Exception: return False
        try:
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                pass
        except Exception:
            return False
        return True

    t = template("{% for i in range(100000) %}{% for j in range(100000) %}{{ swallowing() }}{% endfor %}"
                 "{% endfor %}")
    t._template.globals["swallowing"] = swallowing
    out = _render_in_thread(t)
    assert isinstance(out[0], PromptError) and "did not finish within 0.05 s" in str(out[0])
    real = template("{% for i in range(100000) %}{% for j in range(100000) %}{% if nope is sequence %}{% endif %}"
                    "{% endfor %}{% endfor %}")  # the same through jinja2's test, by chance on each render
    for _ in range(20):
        out = _render_in_thread(real)
        assert isinstance(out[0], PromptError), out


def test_deadlines_passing_as_renders_end_do_not_deadlock_the_watchdog():
    """A deadline passing just as a render ended raised in Condition.__enter__ (Python code) after it
    took the watchdog's lock and before the `with` owned it: the lock stayed held, and every later
    render (a server's every chat request) and the watchdog waited on it for good."""
    code = textwrap.dedent("""
        import threading
        from trtgraph.models import chat_bounds
        from trtgraph.models.chat import ChatTemplate
        from trtgraph.errors import PromptError
        chat_bounds.RENDER_SECONDS = 0.0001
        t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "ckpt", {})
        counts = {"ok": 0, "refused": 0}
        def go():
            for _ in range(1500):
                try:
                    t.render([{"role": "user", "content": "hi"}])
                    counts["ok"] += 1
                except PromptError:
                    counts["refused"] += 1
        threads = [threading.Thread(target=go) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        print("done", counts["ok"] + counts["refused"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=20,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert "done 6000" in proc.stdout and "Traceback" not in proc.stderr, proc.stdout + proc.stderr



def test_deadlines_landing_as_failing_renders_import_do_not_deadlock():
    """jinja2 imports jinja2.debug when a render first fails (its traceback rewrite): a deadline landing
    in that first import left importlib's module lock held, and every later failing render waited on it
    for good. (A fresh interpreter: the module must not be imported yet.)"""
    code = textwrap.dedent("""
        import threading
        from trtgraph.models import chat_bounds
        from trtgraph.models.chat import ChatTemplate
        from trtgraph.errors import PromptError
        chat_bounds.RENDER_SECONDS = 0.0001
        t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}{{ raise_exception('no') }}", "ckpt", {})
        refused = []
        def go():
            for _ in range(1500):
                try:
                    t.render([{"role": "user", "content": "hi"}])
                except PromptError:
                    refused.append(1)
        threads = [threading.Thread(target=go) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        print("done", len(refused))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=20,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert "done 6000" in proc.stdout and "Traceback" not in proc.stderr, proc.stdout + proc.stderr


LOOPING = ("{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
           "{% endfor %}{% endfor %}{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_a_server_refuses_a_chat_its_template_loops_on_with_a_400_and_serves_the_next(default_artifacts,
                                                                                      one_torch_thread, monkeypatch):
    import openai

    from test_server import error_of, serving

    monkeypatch.setattr(chat_bounds, "RENDER_SECONDS", 0.5)
    with serving(default_artifacts) as server:
        server.engine.admission.chat_template = template(LOOPING)
        (model,) = [m.id for m in server.client().models.list().data]
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as exc:
            server.client().chat.completions.create(model=model, messages=[{"role": "user", "content": "loop"}],
                                                    max_tokens=2)
        assert time.monotonic() - start < 10
        assert "did not finish within 0.5 s" in error_of(exc.value)["message"]
        chat = server.client().chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=2, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
        assert server.idle_and_leak_free()


def test_a_long_chat_with_whole_message_lists_in_its_loop_renders_as_fast_as_before():
    """The text bounds walk a value only where it is made text, compared or handed to a C method:
    `messages | length`, `messages is defined` or a macro taking `messages` on every turn stay O(1)."""
    t = template("{% macro show(m, all) %}{{ m.role }}{% endmacro %}{% for m in messages %}"
                 "{% if loop.index0 < messages | length and messages is defined %}{{ show(m, messages) }}"
                 "{% if m is mapping %}:{% endif %}{% endif %}{% endfor %}")
    start = time.monotonic()
    assert t.render([{"role": "user", "content": "hello there " * 10}] * 2000) == "user:" * 2000
    assert time.monotonic() - start < 1.5


# ---- --resume --------------------------------------------------------------------------------

def test_resume_of_escaped_unicode_and_integer_ids_and_a_refusal_leaving_the_summary(default_artifacts, tmp_path):
    """Held: the same requests written with \\u escapes and reordered keys resume (integer ids too);
    an edited one is refused with --summary-json's file and the output untouched."""
    import json

    from click.testing import CliRunner

    from trtgraph.cli import main

    rows = [{"id": 7, "prompt": "ünï €", "max_tokens": 2, "temperature": 0},
            {"id": "b", "prompt": "x\ty", "max_tokens": 3, "temperature": 1.0, "seed": 5}]
    prompts, out, summary = tmp_path / "p.jsonl", tmp_path / "out.jsonl", tmp_path / "s.json"
    prompts.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    run = lambda *extra: CliRunner().invoke(main, ["run", "--prompts", str(prompts), "--manifest",  # noqa: E731
                                                   str(default_artifacts), "--output", str(out), *extra])
    assert run().exit_code == 0
    full = out.read_text(encoding="utf-8").splitlines()
    out.write_text(full[0] + "\n", encoding="utf-8")  # interrupted after the first
    prompts.write_text("".join(json.dumps(dict(reversed(list(r.items()))), ensure_ascii=True, indent=None) + "\n"
                               for r in rows), encoding="utf-8")
    res = run("--resume")
    assert res.exit_code == 0, res.output
    assert [json.loads(x)["id"] for x in out.read_text(encoding="utf-8").splitlines()] == ["7", "b"]
    summary.write_text("earlier", encoding="utf-8")
    before = out.read_bytes()
    prompts.write_text("".join(json.dumps({**r, "max_tokens": 4}) + "\n" for r in rows), encoding="utf-8")
    res = run("--resume", "--summary-json", str(summary))
    assert res.exit_code == 2 and "the result for id '7'" in res.stderr and f"{prompts} line 1" in res.stderr
    assert out.read_bytes() == before and summary.read_text(encoding="utf-8") == "earlier"
