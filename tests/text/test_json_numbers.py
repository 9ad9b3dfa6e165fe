"""JSON numbers under a schema have a bounded length (text/json_grammar.py): at most 17 significant
digits and a 3-digit exponent, wherever the schema lets a number through; the rest of the schema
means what llguidance makes of it."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler
from pdserve.protocol.sampling import SamplingParams, StructuredOutput
from pdserve.text.grammar import GrammarCompiler
from pdserve.text.json_grammar import MAX_DIGITS, schema_grammar
from pdserve.text.tools import Function, call_grammar, call_text
from tests.helpers.tiny_llama import default_tokenizer

NUMBER = {"type": "number"}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
          "required": ["answer", "confidence"]}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(default_tokenizer())


def accepts(compiler: GrammarCompiler, kind: str, spec, text: str) -> bool:
    tok = default_tokenizer()
    m = compiler.compile(StructuredOutput(kind, spec if isinstance(spec, str) else json.dumps(spec)))
    if not m.advance_all(tok.encode(text, add_special_tokens=False)):
        return False
    return m.error is None if m.done else m.advance(tok.eos_token_id) and m.error is None


@pytest.mark.parametrize("text", ["0.5", "-12.75e-3", "12345678901234567", "0", "-0.25", "1E+308", "0.12345678901234567",
                                  "1234567890.1234567", "6.02e23"])
def test_a_number_a_double_holds_is_accepted(compiler, text):
    assert accepts(compiler, "json_schema", NUMBER, text)


@pytest.mark.parametrize("text", ["0." + "1" * 40, "123456789012345678", "1.23456789012345678", "1e1000", "01", "1.",
                                  ".5", "1e"])
def test_a_number_past_the_bound_or_malformed_is_refused(compiler, text):
    assert not accepts(compiler, "json_schema", NUMBER, text)


def test_integers_hold_at_most_17_digits(compiler):
    assert accepts(compiler, "json_schema", {"type": "integer"}, "-" + "9" * MAX_DIGITS)
    assert not accepts(compiler, "json_schema", {"type": "integer"}, "1" * (MAX_DIGITS + 1))
    assert not accepts(compiler, "json_schema", {"type": "integer"}, "1.5")


def test_a_ranged_number_keeps_its_range_and_a_bounded_fraction(compiler):
    ranged = {"type": "number", "minimum": 0, "maximum": 1}
    assert accepts(compiler, "json_schema", ranged, "0.25") and accepts(compiler, "json_schema", ranged, "1")
    assert not accepts(compiler, "json_schema", ranged, "1.5")
    assert not accepts(compiler, "json_schema", ranged, "0." + "9" * 40)
    open_above = {"type": "integer", "minimum": 10}
    assert accepts(compiler, "json_schema", open_above, "12") and not accepts(compiler, "json_schema", open_above, "9")
    assert not accepts(compiler, "json_schema", open_above, "1" * (MAX_DIGITS + 1))


@pytest.mark.parametrize(("kind", "spec", "text"), [
    ("json_schema", ANSWER, '{"answer":"yes","confidence":0.' + "9" * 40 + "}"),
    ("json_schema", ANSWER, '{"answer":"yes","confidence":1,"extra":[0.' + "9" * 40 + "]}"),
    ("json_schema", {"type": "array", "items": NUMBER}, "[1,2," + "3" * 30 + "]"),
    ("json_schema", {"$defs": {"p": {"type": "object", "properties": {"x": NUMBER}}},
                     "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}}, '{"p":{"x":' + "1" * 30 + "}}"),
    ("json_schema", {"anyOf": [{"type": "string"}, NUMBER]}, "1" * 30),
    ("json_object", "", '{"a":{"b":[0.' + "1" * 40 + "]}}"),
], ids=["a property", "an additional property", "array items", "through a $ref", "anyOf", "json_object"])
def test_numbers_are_bounded_wherever_a_schema_lets_one_through(compiler, kind, spec, text):
    assert not accepts(compiler, kind, spec, text)
    assert accepts(compiler, kind, spec, text.replace("9" * 40, "9").replace("1" * 40, "1").replace("1" * 30, "1")
                   .replace("3" * 30, "3"))


@pytest.mark.parametrize(("schema", "good", "bad"), [
    (ANSWER, '{"answer":"yes","confidence":0.5,"n":{"k":[true,null]}}', '{"confidence":0.5,"answer":"yes"}'),
    ({**ANSWER, "additionalProperties": False}, '{"answer":"yes","confidence":0.5}', '{"answer":"y","confidence":1,"n":1}'),
    ({"type": "object", "properties": {"a": NUMBER, "b": NUMBER}}, '{"b":2}', '{"a":1,"a":2}'),
    ({"type": "array", "prefixItems": [{"type": "string"}, NUMBER], "items": False}, '["x",1]', '["x",1,2]'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1,2,3]", "[1]"),
    ({"type": ["number", "null"]}, "null", '"x"'),
    ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 2}, "n": NUMBER}}, '{"s":"ab","n":1}',
     '{"s":"abc","n":1}'),
], ids=["declared then other keys", "no other keys", "optional properties", "prefix items", "item counts",
        "a list of types", "a string's own limits"])
def test_the_rewritten_schema_means_what_it_says(compiler, schema, good, bad):
    assert accepts(compiler, "json_schema", schema, good)
    assert not accepts(compiler, "json_schema", schema, bad)


def test_a_schema_the_rewrite_does_not_know_compiles_as_it_is(compiler):
    schema = {"type": "object", "patternProperties": {"^x": NUMBER}}
    assert schema_grammar(schema) is None
    assert accepts(compiler, "json_schema", schema, '{"x1":2}')


def test_a_forced_calls_numeric_arguments_are_bounded(compiler):
    f = Function("locate", None, {"type": "object", "properties": {"lat": NUMBER}, "required": ["lat"]})
    g = call_grammar([f])
    assert accepts(compiler, "grammar", g, call_text("locate", {"lat": 59.91}))
    assert not accepts(compiler, "grammar", g, call_text("locate", '{"lat": 0.' + "9" * 40 + "}"))


def test_a_generation_that_favours_digits_cannot_grow_a_number_past_the_bound(compiler):
    # A "model" whose favourite token is "9", under the schema of the report: the number ends
    # at the bound, the object closes, and the grammar ends the request well before max_tokens.
    tok = default_tokenizer()
    schema = {**ANSWER, "properties": {"confidence": NUMBER}, "required": ["confidence"],
              "additionalProperties": False}
    spec = StructuredOutput("json_schema", json.dumps(schema))
    r = Request("r", [1, 2, 3], SamplingParams(structured=spec, temperature=0, max_tokens=200), (2, 0))
    r.grammar = compiler.compile(spec)
    nine = tok.encode("9")[0]
    sampler = Sampler()
    status = None
    while status is None:
        logits = torch.randn(1, tok.vocab_size, generator=torch.Generator().manual_seed(r.num_output_tokens))
        logits[0, nine] = 100.0
        r.append_token(sampler(logits, [r]).token_ids[0])
        status = r.check_stop(max_model_len=10_000)
    text = tok.decode(r.token_ids[3:])
    assert status is RequestStatus.FINISHED_STOPPED and r.num_output_tokens < 60, text
    mantissa = text.split(":")[1].rstrip("}").lower().split("e")[0]
    assert sum(c.isdigit() for c in mantissa.removeprefix("-").removeprefix("0.")) <= MAX_DIGITS
    assert isinstance(json.loads(text)["confidence"], float | int)
