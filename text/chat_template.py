"""Chat templates rendered safely: jinja2's immutable sandbox, a time budget, an output cap.

Templates come with model files and may be hostile or broken; every way they fail comes out as a
ValueError the API turns into a 400.
"""

from __future__ import annotations

import functools
import json
import math
import time
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError, TemplateSyntaxError
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

CHAT_TEMPLATE_TIMEOUT_S = 5.0
MAX_RENDERED_CHARS = 8_000_000
_MAX_REPEAT_ITEMS = 1_000_000
_deadline: ContextVar[float] = ContextVar("chat_template_deadline", default=math.inf)


class _TemplateTimeout(Exception):
    pass


def _check_deadline() -> None:
    if time.monotonic() > _deadline.get():
        raise _TemplateTimeout


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, checking the render's deadline on every call, attribute and item access,
    and refusing `*`/`**` results big enough to exhaust memory."""

    intercepted_binops = frozenset({"*", "**"})

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        return super().call(context, obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                too_big = isinstance(n, int) and len(seq) * n > _MAX_REPEAT_ITEMS
                if isinstance(seq, (str, list, tuple)) and too_big:
                    raise SecurityError("the chat template repeats a sequence too many times")
        elif operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise SecurityError("the chat template raises to too large a power")
        return super().call_binop(context, operator, left, right)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; serving renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _TemplateNamespace(Namespace):
    # Underscore names could reach interpreter internals; transformers refuses them too.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: unlike jinja's, it does not HTML-escape.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


_ENV = _ChatTemplateEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(
    raise_exception=_raise_exception,
    strftime_now=_strftime_now,
    dict=_make_dict,
    namespace=_TemplateNamespace,
)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Template:
    return _ENV.from_string(template)


def render_chat_template(template: str, **context: Any) -> str:
    """Render a chat template with `context` (messages, add_generation_prompt, bos_token, ...)."""
    try:
        compiled = _compile(template)
    except TemplateSyntaxError as err:
        raise ValueError(
            f"the chat template does not parse: {err.message} (line {err.lineno})"
        ) from None
    context = {"tools": None, "documents": None, **context}
    token = _deadline.set(time.monotonic() + CHAT_TEMPLATE_TIMEOUT_S)
    try:
        pieces, size = [], 0
        for piece in compiled.generate(**context):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise ValueError(
                    f"the chat template produced more than {MAX_RENDERED_CHARS} characters"
                )
            _check_deadline()
            pieces.append(piece)
        return "".join(pieces)
    except _TemplateTimeout:
        raise ValueError(
            f"the chat template ran longer than {CHAT_TEMPLATE_TIMEOUT_S:g} s; it may loop forever"
        ) from None
    except TemplateError as err:  # raise_exception(...) and sandbox refusals land here
        raise ValueError(f"chat template error: {err.message or err}") from None
    except RecursionError:
        raise ValueError("the chat template recursed too deeply") from None
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"the chat template failed: {type(err).__name__}: {err}") from None
    finally:
        _deadline.reset(token)
