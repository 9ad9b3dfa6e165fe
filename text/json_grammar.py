r"""JSON schemas as llguidance Lark grammars whose numbers have a bounded length.

llguidance's JSON compiler writes a number as `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`
and has no option to bound it, so a model may write `0.99999...` until max_tokens. A parser
reads a JSON number as a double, which holds at most 17 significant digits, so we bound every
number a schema lets through:

- `number`: at most 17 digits in the integer part and the fraction together (a leading `0.` not
  counted), an exponent of at most 3 digits;
- `integer`: at most 17 digits;
- a number with `minimum`/`maximum`/`multipleOf` is llguidance's own range (which has no
  exponent), bounded on each open side at 17 digits and, without a `multipleOf`, held to 10
  decimals (`multipleOf: 1e-10`, the finest llguidance compiles exactly).

The schema is rewritten into Lark where a number may occur: objects (`properties`, `required`,
`additionalProperties`, in llguidance's order: declared properties in schema order, then other
keys), arrays (`items`, `prefixItems`, `minItems`, `maxItems`), `anyOf`/`oneOf`, `$ref` into
`$defs`/`definitions`, lists of types, and any value. A subschema that cannot hold a number
(a string, an enum, a const, ...) is left to llguidance's compiler as `%json{...}`, so it keeps
llguidance's semantics exactly. A schema that uses another keyword where a number may occur is
not rewritten (`None`): it compiles as it is, its numbers unbounded.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DIGITS = 17  # significant digits of a double
MAX_EXPONENT_DIGITS = 3  # a double's exponent is at most 308
_INT_BOUND = 10**MAX_DIGITS - 1
_DECIMALS = 1e-10  # the finest multipleOf llguidance's range compiler takes exactly

NUMBER = (
    rf"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]{{1,{MAX_EXPONENT_DIGITS}}})?/"
    rf" & /-?(0\.)?([0-9]\.?){{1,{MAX_DIGITS}}}([eE].*)?/"
)
INTEGER = rf"/-?(0|[1-9][0-9]{{0,{MAX_DIGITS - 1}}})/"
_STRING_BODY = r'"(\\(["\\\/bfnrt]|u[a-fA-F0-9]{4})|[^"\\\x00-\x1F\x7F])*"'

# Keywords that change nothing a grammar enforces.
_IGNORED = frozenset({"title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                      "writeOnly", "$schema", "$id", "$anchor", "x-guidance"})
_NUMBER_KEYS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_OBJECT_KEYS = frozenset({"properties", "required", "additionalProperties"})
_ARRAY_KEYS = frozenset({"items", "prefixItems", "minItems", "maxItems"})
_STRING_KEYS = frozenset({"minLength", "maxLength", "pattern", "format"})
_KNOWN = _IGNORED | _NUMBER_KEYS | _OBJECT_KEYS | _ARRAY_KEYS | _STRING_KEYS | {"type", "$defs", "definitions"}
_REF = re.compile(r"#/(\$defs|definitions)/([^/]+)")
_EMPTY = '""'


class Unsupported(Exception):
    """The schema uses, where a number may occur, something this rewrite does not translate."""


def schema_grammar(schema: Any, item_separator: str = ",", key_separator: str = ":") -> str | None:
    """A Lark grammar (start rule `start`) for JSON values of `schema`, written with these
    separators and no whitespace, numbers bounded; None when the schema is not rewritten."""
    rules = schema_rules(schema, "start", item_separator, key_separator)
    return None if rules is None else "\n".join([*rules, *terminals()]) + "\n"


def schema_rules(schema: Any, name: str, item_separator: str = ",", key_separator: str = ":") -> list[str] | None:
    """The Lark rules defining `name` (the others named `name__...`), without the terminals
    (`terminals()`, once per grammar); None when the schema is not rewritten."""
    try:
        translator = _Translator(schema, name, item_separator, key_separator)
        translator.rule(name, translator.expr(schema))
    except (Unsupported, RecursionError):
        return None
    return list(translator.rules.values())


def terminals() -> list[str]:
    return [f"NUMBER: {NUMBER}", f"INTEGER: {INTEGER}", f"STRING: /{_STRING_BODY}/"]


class _Translator:
    def __init__(self, root: Any, prefix: str, item_sep: str, key_sep: str) -> None:
        self.prefix = prefix
        self.item, self.key = _literal(item_sep), _literal(key_sep)
        self.style = {"whitespace_flexible": False, "item_separator": item_sep, "key_separator": key_sep}
        self.defs: dict[str, Any] = {}
        if isinstance(root, dict):
            for where in ("$defs", "definitions"):
                if isinstance(root.get(where), dict):
                    self.defs[where] = root[where]
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}  # "#/$defs/X" -> its rule
        self._count = 0

    # --- rules ---------------------------------------------------------------------------

    def rule(self, name: str, body: str) -> str:
        self.rules[name] = f"{name}: {body}"
        return name

    def fresh(self, body: str) -> str:
        self._count += 1
        return self.rule(f"{self.prefix}__{self._count}", body)

    def any_value(self) -> str:
        value = f"{self.prefix}__value"
        if value not in self.rules:
            obj, arr, pair = (f"{self.prefix}__{x}" for x in ("object", "array", "pair"))
            self.rule(value, f'{obj} | {arr} | STRING | NUMBER | "true" | "false" | "null"')
            self.rule(obj, f'"{{" ({pair} ({self.item} {pair})*)? "}}"')
            self.rule(pair, f"STRING {self.key} {value}")
            self.rule(arr, f'"[" ({value} ({self.item} {value})*)? "]"')
        return value

    def delegate(self, node: Any) -> str:
        """llguidance's own compilation of a subschema that holds no unbounded number."""
        text = json.dumps(node)
        refs = re.findall(r'"\$ref":\s*"((?:[^"\\]|\\.)*)"', text)
        if any(not _REF.fullmatch(r) for r in refs):
            raise Unsupported
        body = {**node, **(self.defs if refs else {}), "x-guidance": self.style}
        return self.fresh("%json " + json.dumps(body, ensure_ascii=False))

    # --- schemas -------------------------------------------------------------------------

    def expr(self, node: Any) -> str:
        if node is True or (isinstance(node, dict) and not set(node) - _IGNORED - {"$defs", "definitions"}):
            return self.any_value()
        if not isinstance(node, dict):
            raise Unsupported  # false, or not a schema: llguidance says why
        if not self.may_hold_number(node, set()):
            return self.delegate({k: v for k, v in node.items() if k not in ("$defs", "definitions")})
        keys = set(node) - _IGNORED - {"$defs", "definitions"}
        if "$ref" in keys:
            if keys != {"$ref"}:
                raise Unsupported
            return self.ref(node["$ref"])
        for combinator in ("anyOf", "oneOf"):
            if combinator in keys:
                if keys != {combinator} or not isinstance(node[combinator], list) or not node[combinator]:
                    raise Unsupported
                return self.fresh(" | ".join(self.expr(option) for option in node[combinator]))
        if keys - _KNOWN or "type" not in keys:
            raise Unsupported
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        if not types or not all(isinstance(t, str) for t in types):
            raise Unsupported
        if len(types) > 1:
            return self.fresh(" | ".join(self.expr({**node, "type": t}) for t in types))
        kind = types[0]
        if kind in ("number", "integer"):
            return self.number(node, kind)
        if kind == "object":
            return self.object(node)
        if kind == "array":
            return self.array(node)
        return self.delegate({k: v for k, v in node.items() if k not in ("$defs", "definitions")})

    def ref(self, ref: Any) -> str:
        match = _REF.fullmatch(ref) if isinstance(ref, str) else None
        if match is None or match.group(2) not in self.defs.get(match.group(1), {}):
            raise Unsupported
        if ref not in self.refs:
            self._count += 1
            name = self.refs[ref] = f"{self.prefix}__ref{self._count}"
            self.rules[name] = ""  # reserved: a recursive reference finds it
            self.rule(name, self.expr(self.defs[match.group(1)][match.group(2)]))
        return self.refs[ref]

    def number(self, node: dict, kind: str) -> str:
        bounds = {k: node[k] for k in _NUMBER_KEYS if k in node}
        if not bounds:
            return "NUMBER" if kind == "number" else "INTEGER"
        lows = [v for k, v in bounds.items() if k in ("minimum", "exclusiveMinimum") and isinstance(v, int | float)]
        highs = [v for k, v in bounds.items() if k in ("maximum", "exclusiveMaximum") and isinstance(v, int | float)]
        if not lows and (not highs or min(highs) > -_INT_BOUND):
            bounds["minimum"] = -_INT_BOUND
        if not highs and (not lows or max(lows) < _INT_BOUND):
            bounds["maximum"] = _INT_BOUND
        if kind == "number" and "multipleOf" not in bounds:
            bounds["multipleOf"] = _DECIMALS
        return self.delegate({"type": kind, **bounds})

    def object(self, node: dict) -> str:
        props = node.get("properties", {})
        required = node.get("required", [])
        extra = node.get("additionalProperties", True)
        if not isinstance(props, dict) or not isinstance(required, list) or any(r not in props for r in required):
            raise Unsupported
        pairs = [f"{_literal(json.dumps(k, ensure_ascii=False))} {self.key} {self.expr(v)}" for k, v in props.items()]
        optional = [k not in required for k in props]
        # first[k]: properties k.. with none written yet; rest[k]: the same after one was.
        if extra is False:
            first, rest = "", ""
        else:
            key = self.other_keys(list(props))
            pair = self.fresh(f"{key} {self.key} {self.expr(extra)}")
            rest = f"({self.item} {pair})*"
            first = f"({pair} {rest})?"
        for k in range(len(pairs) - 1, -1, -1):
            tail = self.fresh(rest) if rest else _EMPTY
            if optional[k]:
                first = f"{pairs[k]} {tail} | {self.fresh(first) if first else _EMPTY}"
                rest = f"({self.item} {pairs[k]})? {tail}"
            else:
                first = f"{pairs[k]} {tail}"
                rest = f"{self.item} {pairs[k]} {tail}"
        return self.fresh(f'"{{" {self.fresh(first) if first else ""} "}}"')

    def other_keys(self, names: list[str]) -> str:
        """A terminal for object keys other than `names`."""
        if not names:
            return "STRING"
        self._count += 1
        name = f"{self.prefix.upper()}__KEY{self._count}"
        escaped = "|".join(re.escape(json.dumps(n, ensure_ascii=False)) for n in names).replace("/", "\\/")
        self.rules[name] = f"{name}: /{_STRING_BODY}/ & ~/({escaped})/"
        return name

    def array(self, node: dict) -> str:
        prefix = node.get("prefixItems", [])
        items = node.get("items", True)
        low, high = node.get("minItems", 0), node.get("maxItems")
        if not isinstance(prefix, list) or not isinstance(low, int) or not (high is None or isinstance(high, int)):
            raise Unsupported
        if items is False:
            high = len(prefix) if high is None else min(high, len(prefix))
        if high is not None and (high < low or high == 0):
            if high < low:
                raise Unsupported  # unsatisfiable: llguidance says so
            return self.fresh('"[" "]"')
        elements = [self.expr(p) for p in prefix]
        item = self.expr(items) if items is not False else None

        def after(i: int) -> str:  # elements i.. (each after a separator), i already written
            if i < len(elements):
                part = f"{self.item} {elements[i]} {after(i + 1)}"
                return part if i < low else f"({part})?"
            if item is None or (high is not None and i >= high):
                return ""
            need = max(low - i, 0)
            more = f"({self.item} {item})"
            if high is None:
                return f"{more}{{{need}}} {more}*" if need else f"{more}*"
            return f"{more}{{{need},{high - i}}}"

        body = self.fresh(f"{elements[0] if elements else item} {after(1)}")
        return self.fresh(f'"[" {body} "]"' if low >= 1 else f'"[" {body}? "]"')

    def may_hold_number(self, node: Any, seen: set[str]) -> bool:
        """Whether a value of `node` may contain a number not bounded by its own listing."""
        if node is True:
            return True
        if not isinstance(node, dict):
            return False
        if "const" in node or "enum" in node:
            return False  # the values are listed: as long as the listing
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in seen:
                return False
            match = _REF.fullmatch(ref)
            target = self.defs.get(match.group(1), {}).get(match.group(2)) if match else None
            if target is None or self.may_hold_number(target, seen | {ref}):
                return True
        for combinator in ("anyOf", "oneOf", "allOf"):
            if any(self.may_hold_number(s, seen) for s in node.get(combinator) or ()):
                return True
        types = node.get("type")
        if types is None:
            return not (set(node) & {"$ref", "anyOf", "oneOf", "allOf"})
        types = types if isinstance(types, list) else [types]
        if "number" in types or "integer" in types:
            return True
        if "object" in types:
            subs = [*(node.get("properties") or {}).values(), node.get("additionalProperties", True),
                    *(node.get("patternProperties") or {}).values()]
            if any(self.may_hold_number(s, seen) for s in subs):
                return True
        if "array" in types:
            subs = [node.get("items", True), *(node.get("prefixItems") or ()), node.get("contains", False)]
            if any(self.may_hold_number(s, seen) for s in subs):
                return True
        return False


def _literal(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)
