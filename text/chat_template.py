"""Chat templates rendered safely: jinja2's immutable sandbox, a time budget, an output cap.

Templates come with model files and may be hostile or broken; every way they fail comes out as a
ValueError the API turns into a 400. The deadline is checked inside every loop (each iteration)
and the cap inside every concatenation (`~`, `+`, `*`, join, replace, widths), not only at the
output: a template can build or spin without writing anything.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError, TemplateSyntaxError, nodes, pass_context
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
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


def _check_size(value: Any) -> Any:
    """`value`, unless it is a string or sequence longer than the render's output cap."""
    if isinstance(value, str | list | tuple) and len(value) > MAX_RENDERED_CHARS:
        raise SecurityError(f"the chat template built a value of more than {MAX_RENDERED_CHARS} items")
    return value


@pass_context  # never folded into a constant at compile time: it is a generator
def _checked_iter(_context: Any, iterable: Any) -> Any:
    """A loop's items, checking the render's deadline before each: a loop over a value computed
    beforehand (`{% for i in r %}`) makes no call the other checks would see."""
    for item in iterable:
        _check_deadline()
        yield item


def _capped_join(parts: Any) -> str:
    """`~` and captured blocks (`{% set x %}`, macro bodies): joined only within the output cap."""
    _check_deadline()
    texts = [p if isinstance(p, str) else str(p) for p in parts]
    if sum(map(len, texts)) > MAX_RENDERED_CHARS:
        raise SecurityError(f"the chat template built a string of more than {MAX_RENDERED_CHARS} characters")
    return "".join(texts)


_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})
_FORMAT_NUMBERS = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?")


def _joined_size(items: Any, sep: str) -> int:
    """The length `sep.join(items)` would have (stops counting past the cap)."""
    total = 0
    if isinstance(items, list | tuple):
        for x in items:
            total += len(x if isinstance(x, str) else str(x)) + len(sep)
            if total > MAX_RENDERED_CHARS:
                break
    return total


def _replaced_size(s: Any, old: Any, new: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    return len(s) + (s.count(old) if old else len(s) + 1) * len(new)


def _format_size(fmt: Any) -> int:
    """The widest field a %-format asks for (`'%999999999s' % x` allocates that much)."""
    if not isinstance(fmt, str):
        return 0
    numbers = [int(n) for m in _FORMAT_NUMBERS.finditer(fmt) for n in m.groups() if n]
    return max(numbers, default=0)


def _str_method_size(owner: str, name: str, args: tuple) -> int:
    """How long a string method's result may get, judged before it runs (0: it does not grow)."""
    if name == "join" and args:
        return _joined_size(args[0], owner)
    if name == "replace" and len(args) >= 2:
        return _replaced_size(owner, args[0], args[1])
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        return args[0]
    if name == "expandtabs" and args and isinstance(args[0], int):
        return len(owner) + owner.count("\t") * args[0]
    return 0


def _refuse_growth(size: int) -> None:
    if size > MAX_RENDERED_CHARS:
        raise SecurityError(f"the chat template would build a string of more than {MAX_RENDERED_CHARS} characters")


def _checked_filter(original: Any, size: Any) -> Any:
    """A filter that refuses, before it runs, a result over the cap (`size(*args)` estimates it)."""

    @functools.wraps(original)  # keeps jinja's pass_eval_context mark
    def checked(*args: Any, **kwargs: Any) -> Any:
        _refuse_growth(size(*args, **kwargs))
        return _check_size(original(*args, **kwargs))

    return checked


class _CheckedCodeGenerator(CodeGenerator):
    """jinja2's compiler, but every for-loop iterates through `_checked_iter` and every `~`
    joins through `_capped_join`: the deadline and the cap hold inside loops and concatenations."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        for loop in list(node.find_all(nodes.For)):
            loop.iter = nodes.Filter(loop.iter, _LOOP_FILTER, [], [], None, None, lineno=loop.lineno)
        super().visit_Template(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


_LOOP_FILTER = "pdserve_checked_loop"


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, checking the render's deadline on every call, attribute and item access and
    loop iteration, and refusing `*`, `**`, `+` and `~` results big enough to exhaust memory."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CheckedCodeGenerator
    concat = staticmethod(_capped_join)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str):  # str.join, replace, center, ...: judged before they build
            _refuse_growth(_str_method_size(owner, getattr(obj, "__name__", ""), args))
        return _check_size(super().call(context, obj, *args, **kwargs))

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
                # The type check first: `len` of a number raises (`{{ 2 * 3 }}` must work).
                if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT_ITEMS:
                    raise SecurityError("the chat template repeats a sequence too many times")
        elif operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise SecurityError("the chat template raises to too large a power")
        elif operator == "%":
            _refuse_growth(_format_size(left))
        return _check_size(super().call_binop(context, operator, left, right))


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
_ENV.filters[_LOOP_FILTER] = _checked_iter
# The filters that can grow a string past its inputs, each judged before it runs.
for _name, _size in {
    "join": lambda _ctx, value, d="", attribute=None: _joined_size(value, d),
    "replace": lambda _ctx, s, old, new, count=None: _replaced_size(s, old, new),
    "center": lambda value, width=80: width if isinstance(width, int) else 0,
    "indent": lambda s, width=4, first=False, blank=False: (
        len(str(s)) + (str(s).count("\n") + 1) * (width if isinstance(width, int) else len(str(width)))),
    "format": lambda value, *args, **kwargs: _format_size(value),
}.items():
    _ENV.filters[_name] = _checked_filter(_ENV.filters[_name], _size)
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
