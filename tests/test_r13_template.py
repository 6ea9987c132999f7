"""A checkpoint's chat template cannot hold a run or a server worker for good: its render has a
deadline and a size limit (models/chat_bounds.py); real templates render as before."""

from __future__ import annotations

import threading
import time

import pytest

from trtgraph.errors import PromptError
from trtgraph.models import chat_bounds
from trtgraph.models.chat import ChatTemplate

from test_chat import LLAMA3, QWEN25

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "¿qué tal? " * 20}]


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, "ckpt/chat_template.jinja", {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.fixture()
def short_deadline(monkeypatch):
    monkeypatch.setattr(chat_bounds, "RENDER_SECONDS", 0.5)


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # 10^10 empty turns
    "{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",  # no call per turn
    "{% macro f(n) %}{% if n < 30 %}{% for i in range(10) %}{{ f(n + 1) }}{% endfor %}{% endif %}{% endmacro %}"
    "{{ f(0) }}",  # 10^30 macro calls
])
def test_a_template_that_never_ends_is_refused_at_the_deadline(source, short_deadline):
    start = time.monotonic()
    with pytest.raises(PromptError, match=r"ckpt/chat_template.jinja went past a render bound.*did not finish "
                                          r"within 0.5 s"):
        template(source).render(MESSAGES)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("source,what", [
    ("{{ 'x' * 10000000000 }}", "repeating"),
    ("{{ ['x'] * 10000000000 }}", "repeating"),
    ("{{ 'x' | center(10000000000) }}", "center"),
    ("{{ 'x'.ljust(10000000000) }}", "ljust"),
    ("{{ '%999999999d' % 1 }}", "%-format"),
    ("{{ '%999999999d' | format(1) }}", "%-format"),
    ("{{ '{:>999999999}'.format(1) }}", "str.format"),
    ("{{ 2 ** 100000000000 }}", "size limit"),
    ("{{ 10 ** (10 ** 10) }}", "size limit"),
    ("{{ '%(a)999999999s' | format(a=1) }}", "%-format"),
    ("{{ messages | tojson(indent=1000000000) }}", "indent"),
    ("{{ (range(100000) | list) | join('x' * 10000) }}", "join"),
    ("{{ ('a' * 20000) | replace('a', 'a' * 20000) }}", "replace"),
    ("{{ ('x' * 200000).join(range(100000) | map('string') | list) }}", "str.join"),
    ("{% set ns = namespace(x=3) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "integers"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "characters or items"),
    ("{% set s = 'ab' * 4000000 %}{{ s.replace('a', s) }}", "replace"),
    ("{% set s = 'y' * 9000000 %}{{ s + s }}", "joining"),
    ("{% for i in range(100000) %}{{ 'z' * 1000 }}{% endfor %}", "rendered prompt passed"),
])
def test_a_template_that_grows_without_end_is_refused_before_it_takes_the_memory(source, what):
    with pytest.raises(PromptError, match="went past a render bound") as exc:
        template(source).render(MESSAGES)
    assert what in str(exc.value)


@pytest.mark.parametrize("source", [LLAMA3, QWEN25])
def test_real_templates_render_as_the_plain_sandbox_renders_them(source):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    plain = env.from_string(source).render(messages=MESSAGES, tools=None, documents=None, add_generation_prompt=True,
                                           bos_token="<s>", eos_token="</s>")
    assert template(source).render(MESSAGES) == plain


def test_a_refused_render_leaves_nothing_pending_for_the_thread(short_deadline):
    slow = template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    fast = template(LLAMA3)
    for _ in range(3):
        with pytest.raises(PromptError):
            slow.render(MESSAGES)
        assert fast.render(MESSAGES)  # the next render, and plain code after, run undisturbed
        total = 0
        for i in range(200000):  # bytecode after the render: no stray timeout arrives here
            total += i
        time.sleep(0.6)  # past the refused render's deadline again
        assert total == sum(range(200000))


def test_renders_in_many_threads_time_out_alone(short_deadline):
    slow = template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    fast = template(QWEN25)
    results: dict[str, object] = {}

    def run(name, tpl):
        try:
            results[name] = tpl.render(MESSAGES)
        except PromptError as exc:
            results[name] = exc

    threads = [threading.Thread(target=run, args=(f"slow{i}", slow)) for i in range(3)]
    threads += [threading.Thread(target=run, args=(f"fast{i}", fast)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(isinstance(results[f"slow{i}"], PromptError) for i in range(3))
    assert all(isinstance(results[f"fast{i}"], str) for i in range(3))


def test_a_render_stopped_at_its_deadline_leaves_no_pending_state_behind():
    """Found by the sixteenth session's suite: the watchdog's clearing call (PyThreadState_SetAsyncExc
    with NULL) left CPython 3.11's eval loop flagged for good, so any profile function set later (cProfile,
    coverage, a debugger) spun forever at its next call. Run in a child process: the old code hangs."""
    import os
    import subprocess
    import sys

    script = """
import cProfile, time
from trtgraph.models import chat_bounds
from trtgraph.models.chat import ChatTemplate
from trtgraph.errors import PromptError
chat_bounds.RENDER_SECONDS = 0.3
t = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "x.jinja",
                 {"bos_token": "<s>", "eos_token": "</s>"})
try:
    t.render([{"role": "user", "content": "hi"}])
except PromptError:
    pass
def f():
    return sum(g(i) for i in range(1000))
def g(i):
    return i + 1
cProfile.run("f()", "/dev/null")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]
