"""Structured outputs at the router: every constraint field reaches the worker as one compiled
`StructuredOutput`, and a bad one is a 400 naming its parameter before any worker sees it."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.protocol.sampling import StructuredOutput
from pdserve.text.grammar import MAX_CHOICES, MAX_PATTERN_CHARS, MAX_SCHEMA_DEPTH
from tests.helpers.fake_worker import RouterHarness
from tests.helpers.tiny_llama import default_tokenizer

pytestmark = pytest.mark.timeout(60)

USER = [{"role": "user", "content": "hi"}]
C, P = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**extra) -> dict:
    return {"model": "m", "messages": USER, "max_tokens": 5, **extra}


def comp(**extra) -> dict:
    return {"model": "m", "prompt": "hi", "max_tokens": 5, **extra}


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.fixture(scope="module")
def router():
    tok = default_tokenizer()
    with RouterHarness(tokenizer=tok, served_model_name="m", max_body_bytes=1 << 20) as h:
        h.worker("colo-0", script=tok.encode("{}") + [tok.eos_token_id])
        yield h


@pytest.fixture(scope="module")
def http(router):
    with httpx.Client(base_url=router.base_url, timeout=20) as c:
        yield c


ACCEPTED = [
    ("json_object", C, chat(response_format={"type": "json_object"}), StructuredOutput("json_object")),
    ("json_schema", C, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
     StructuredOutput("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ("text is free", C, chat(response_format={"type": "text"}), None),
    ("guided_json dict", P, comp(guided_json=SCHEMA), StructuredOutput("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ("guided_json text", C, chat(guided_json='{"type": "boolean"}'), StructuredOutput("json_schema", '{"type": "boolean"}')),
    ("guided_regex", P, comp(guided_regex="[0-9]{3}"), StructuredOutput("regex", "[0-9]{3}")),
    ("guided_choice", C, chat(guided_choice=["yes", "no"]), StructuredOutput("choice", '["yes","no"]')),
    ("guided_grammar lark", P, comp(guided_grammar='start: "a" | "b"'), StructuredOutput("grammar", 'start: "a" | "b"')),
    ("guided_grammar gbnf", P, comp(guided_grammar='root ::= "yes" | "no"'), StructuredOutput("grammar", 'root ::= "yes" | "no"')),
    ("structured_outputs.json", C, chat(structured_outputs={"json": SCHEMA}), StructuredOutput("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ("structured_outputs.regex", P, comp(structured_outputs={"regex": "ab+", "disable_any_whitespace": True}), StructuredOutput("regex", "ab+")),
    ("structured_outputs.choice", P, comp(structured_outputs={"choice": ["x"]}), StructuredOutput("choice", '["x"]')),
    ("structured_outputs.json_object", C, chat(structured_outputs={"json_object": True}), StructuredOutput("json_object")),
]


@pytest.mark.parametrize(("path", "body", "want"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_a_constraint_reaches_the_worker_as_one_structured_output(router, http, path, body, want):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert router.workers[0].requests()[-1].sampling.structured == want


REFUSED = [
    # (id, path, body, param)
    ("schema of an unknown type", C, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}), "response_format"),
    ("unsatisfiable schema", P, comp(guided_json={"type": "string", "minLength": 5, "maxLength": 2}), "guided_json"),
    ("unimplemented keyword", C, chat(guided_json={"not": {"type": "string"}}), "guided_json"),
    ("dangling $ref", C, chat(structured_outputs={"json": {"$ref": "#/$defs/nope"}}), "structured_outputs.json"),
    ("schema text not JSON", P, comp(guided_json="{not json"), "guided_json"),
    ("schema not an object", P, comp(guided_json="[1, 2]"), "guided_json"),
    ("schema too deep", C, chat(guided_json=nested(MAX_SCHEMA_DEPTH + 1)), "guided_json"),
    ("schema too big", C, chat(guided_json={"type": "string", "description": "x" * 70_000}), "guided_json"),
    ("regex unclosed group", P, comp(guided_regex="(ab"), "guided_regex"),
    ("regex empty language", P, comp(guided_regex="[^\\x00-\\x{10FFFF}]"), "guided_regex"),
    ("regex too long", P, comp(guided_regex="a" * (MAX_PATTERN_CHARS + 1)), "guided_regex"),
    ("regex nests too deep", C, chat(guided_regex="(" * 40 + "a" + ")" * 40), "guided_regex"),
    ("regex inside a schema", C, chat(guided_json={"type": "string", "pattern": "[a-"}), "guided_json"),
    ("empty choice list", P, comp(guided_choice=[]), "guided_choice"),
    ("too many choices", P, comp(guided_choice=[str(i) for i in range(MAX_CHOICES + 1)]), "guided_choice"),
    ("grammar unknown rule", P, comp(guided_grammar="start: foo"), "guided_grammar"),
    ("grammar syntax error", P, comp(structured_outputs={"grammar": "start: ((("}), "structured_outputs.grammar"),
    # The issue's repro: ~30 KB, 3,000 optional properties; it compiled here and then failed (or
    # stalled) every worker. Refused at the edge by the limit the workers apply too.
    ("3000 optional properties", C, chat(guided_json={"type": "object", "properties": {f"p{i}": {} for i in range(3000)}}),
     "guided_json"),
    ("recursive schema with no base case", C, chat(guided_json={"$ref": "#"}), "guided_json"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_bad_constraint_is_a_400_naming_it_and_the_next_request_succeeds(router, http, path, body, param):
    seen = len(router.workers[0].requests())
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_structured_output", err
    assert set(err) == {"message", "type", "param", "code"}
    assert len(router.workers[0].requests()) == seen  # no worker saw it
    ok = http.post(C, json=chat(response_format={"type": "json_object"}))
    assert ok.status_code == 200
    assert router.service.inflight == 0


def test_the_compile_time_bound_is_a_router_flag():
    import argparse

    from pdserve.config.router import router_config
    from pdserve.router.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert router_config(p.parse_args([])).grammar_timeout == 5.0
    assert router_config(p.parse_args(["--grammar-timeout", "0.5"])).grammar_timeout == 0.5
