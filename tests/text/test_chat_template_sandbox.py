"""The chat template sandbox: arithmetic works; the render deadline and the output cap hold inside
every loop and every concatenation, not only at calls and at the output."""

from __future__ import annotations

import threading
import time

import pytest

import pdserve.text.chat_template as chat_template_module
from pdserve.text.chat_template import render_chat_template


def render_within(template: str, seconds: float) -> tuple[str | None, Exception | None, float]:
    """Render on a daemon thread and stop waiting after `seconds`: a runaway fails the test
    instead of hanging it."""
    result: list = [None, None]

    def run() -> None:
        try:
            result[0] = render_chat_template(template, messages=[])
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            result[1] = exc

    start = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the render was still running after {seconds} s"
    return result[0], result[1], time.monotonic() - start


@pytest.mark.parametrize(("template", "expected"), [
    ("{{ 2 * 3 }}", "6"), ("{{ 3 * 'ab' }}", "ababab"), ("{{ [0] * 2 }}", "[0, 0]"),
    ("{{ 1 + 2 }}|{{ 'a' + 'b' }}|{{ 'a' ~ 1 }}", "3|ab|a1"),
    ("{% for i in [1, 2] %}{{ i }}{{ loop.last }}{% endfor %}{% for m in messages %}{% else %}-{% endfor %}",
     "1False2True-"),
])
def test_arithmetic_concatenation_and_loops_render(template, expected):
    assert render_chat_template(template, messages=[]) == expected


def test_a_loop_over_a_precomputed_range_stops_at_the_deadline(monkeypatch):
    monkeypatch.setattr(chat_template_module, "CHAT_TEMPLATE_TIMEOUT_S", 0.3)
    # No call, attribute or output inside the loops: only the loop itself can check the clock.
    loops = "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"
    _, error, took = render_within(loops, 5.0)
    assert isinstance(error, ValueError) and "ran longer than" in str(error)
    assert took < 2.0


@pytest.mark.parametrize("op", ["~", "+"])
def test_string_growth_by_concatenation_is_capped(op):
    # 24 doublings: 16 M characters, over the 8 M cap, built without any output.
    doubling = ("{% set ns = namespace(s='x') %}{% for i in range(24) %}"
                f"{{% set ns.s = ns.s {op} ns.s %}}{{% endfor %}}{{{{ ns.s | length }}}}")
    _, error, _ = render_within(doubling, 5.0)
    assert isinstance(error, ValueError) and "more than 8000000" in str(error)


def test_a_captured_block_is_capped():
    body = "x" * 1000
    template = (f"{{% set s %}}{{% for i in range(10000) %}}{body}{{% endfor %}}{{% endset %}}"
                "{{ s | length }}")
    _, error, _ = render_within(template, 5.0)
    assert isinstance(error, ValueError) and "more than 8000000" in str(error)


@pytest.mark.parametrize("template", [
    "{{ (['x' * 1000000] * 1000000) | join }}",
    "{{ ''.join(['x' * 1000000] * 1000000) }}",
    "{{ ('x' * 1000000) | replace('x', 'y' * 1000) }}",
    "{{ ('x' * 1000000).replace('x', 'yy' * 1000) }}",
    "{{ 'a' | center(1000000000) }}",
    "{{ 'x'.rjust(1000000000) }}",
    "{{ ('x\n' * 100000) | indent(1000) }}",
    "{{ '%1000000000s' | format('x') }}",
    "{{ '%1000000000s' % 'x' }}",
], ids=["join filter", "str.join", "replace filter", "str.replace", "center", "rjust", "indent", "format filter",
        "% format"])
def test_string_growth_by_join_replace_or_width_is_refused_before_it_is_built(template):
    _, error, took = render_within(template, 5.0)
    assert isinstance(error, ValueError) and "more than 8000000" in str(error)
    assert took < 1.0  # refused before building gigabytes


@pytest.mark.parametrize(("template", "expected"), [
    ("{{ ['a', 'b'] | join(',') }}|{{ ','.join(['x', 'y']) }}", "a,b|x,y"),
    ("{{ 'abc' | replace('b', 'x') }}|{{ 'ab'.replace('a', 'z') }}", "axc|zb"),
    ("{{ 'a' | center(5) }}|{{ 'x'.ljust(3) }}|{{ 'a\nb' | indent(2) }}", "  a  |x  |a\n  b"),
    ("{{ '%5.2f' | format(3.14159) }}|{{ '%s-%d' % ('a', 3) }}|{{ 7 % 3 }}", " 3.14|a-3|1"),
])
def test_string_filters_and_methods_within_the_cap_work(template, expected):
    assert render_chat_template(template, messages=[]) == expected
