"""Structured outputs in the engine: the grammar's mask in the sampler, termination, failure,
and the matcher rebuilt from the output tokens another worker produced (the P->D hand-off)."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
import torch

import pdserve.text.grammar as grammar_module
from pdserve.engine.engine import RequestRejected
from pdserve.engine.llm import LLM
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler
from pdserve.protocol.sampling import SamplingParams, StructuredOutput
from pdserve.text.grammar import (
    MAX_PROPERTIES,
    MAX_SCHEMA_DEPTH,
    GrammarCompiler,
    GrammarError,
    bracket_depth,
    check_limits,
    json_depth,
    schema_meaning,
)
from tests.helpers.tiny_llama import default_tokenizer

pytestmark = pytest.mark.timeout(120)

CHOICE = StructuredOutput("choice", '["yes","no"]')
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(default_tokenizer())


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(loaded=tiny, device="cpu", dtype="float32", max_num_seqs=8)


def constrained(compiler, spec: StructuredOutput, **params) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(structured=spec, **params), (2, 0))
    r.grammar = compiler.compile(spec)
    return r


# --- the grammar module ----------------------------------------------------------------------


def test_limits_measure_depth_without_recursion():
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    assert json_depth(deep) == MAX_SCHEMA_DEPTH + 1  # stops counting past the cap
    assert bracket_depth(r"((a)\(\()[b]") == 2


@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", "[" * 40 + "]" * 40),
    StructuredOutput("regex", ""),
    StructuredOutput("choice", '["a", 1]'),
    StructuredOutput("json_schema", '"a string"'),
])
def test_check_limits_refuses_with_a_grammar_error(spec):
    with pytest.raises(GrammarError):
        check_limits(spec)


def wide_schema(n: int, **extra) -> StructuredOutput:
    """An object of `n` optional properties (the issue's repro: 3,000 of them, ~30 KB)."""
    schema = {"type": "object", "properties": {f"p{i}": {} for i in range(n)}, **extra}
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))


def test_an_object_with_more_properties_than_the_limit_is_refused_before_compiling(compiler, monkeypatch):
    spec = wide_schema(3000)
    assert 28_000 < len(spec.spec) < 34_000
    monkeypatch.setattr(grammar_module, "_grammar_of", lambda *a: pytest.fail("compiled"))
    with pytest.raises(GrammarError, match=f"3000 properties; the limit is {MAX_PROPERTIES}"):
        compiler.compile(spec)


def test_an_object_at_the_property_limit_compiles_and_steps(compiler):
    """What the edge accepts works on the worker too: not only the first mask, every step."""
    m = compiler.compile(wide_schema(MAX_PROPERTIES))
    for token in default_tokenizer().encode('{"p5":1,"p7":2,"p200":3}'):
        m.allowed_bitmask()
        assert m.advance(token), m.error
    assert m.error is None


def test_annotations_do_not_defeat_the_compile_cache(monkeypatch):
    compiler = GrammarCompiler(default_tokenizer())
    compiled = []
    real = grammar_module._grammar_of
    monkeypatch.setattr(grammar_module, "_grammar_of", lambda spec, value: compiled.append(value) or real(spec, value))
    compiler.compile(wide_schema(3, title="A", description="first"))
    m = compiler.compile(wide_schema(3, title="B", **{"$comment": "second"}))
    assert len(compiled) == 1 and "title" not in compiled[0]
    compiler.compile(wide_schema(4))  # another meaning compiles
    assert len(compiled) == 2 and m.advance(default_tokenizer().encode("{")[0])


def test_schema_meaning_drops_annotations_only_where_a_keyword_stands():
    schema = {"title": "t", "type": "object", "description": "d",
              "properties": {"title": {"type": "string", "description": "the title"}},
              "anyOf": [{"title": "x", "type": "object"}], "enum_like": {"title": "kept"}}
    assert schema_meaning(schema) == {"type": "object", "properties": {"title": {"type": "string"}},
                                      "anyOf": [{"type": "object"}], "enum_like": {"title": "kept"}}


def test_compiled_matchers_are_independent(compiler):
    tok = default_tokenizer()
    a, b = compiler.compile(CHOICE), compiler.compile(CHOICE)
    assert a.advance_all(tok.encode("yes")) and a.done and a.error is None
    assert not b.done  # the cached grammar and the other copy did not move


def test_a_refused_token_puts_the_matcher_in_error(compiler):
    m = compiler.compile(StructuredOutput("regex", "[0-9]+"))
    assert not m.advance(default_tokenizer().encode("x")[0])
    assert m.done and m.error


# --- the sampler's mask ----------------------------------------------------------------------


def test_mask_allows_only_grammar_tokens_and_leaves_other_rows_alone(compiler):
    tok = default_tokenizer()
    torch.manual_seed(0)
    logits = torch.randn(2, tok.vocab_size)
    free = Request("f", [1, 2, 3], SamplingParams(temperature=0), (2, 0))
    row = constrained(compiler, CHOICE, temperature=0)
    out = Sampler()(logits.clone(), [row, free])
    allowed = {tok.encode("yes")[0], tok.encode("no")[0]} | {t for t in range(tok.vocab_size)
                                                             if tok.decode([t]) in ("y", "n", "ye")}
    assert out.token_ids[0] in allowed
    assert out.token_ids[1] == int(logits[1].argmax())
    assert out.errors == {}


def test_sampled_draws_respect_the_mask(compiler):
    tok = default_tokenizer()
    s = Sampler(seed=5)
    for _ in range(20):
        r = constrained(compiler, StructuredOutput("regex", "[0-9]{2}"), temperature=1.5)
        token = s(torch.randn(1, tok.vocab_size), [r]).token_ids[0]
        assert tok.decode([token]).isdigit()


def test_a_row_with_no_allowed_token_is_reported_not_sampled(compiler):
    tok = default_tokenizer()
    # After "yes" the grammar allows only an end of sequence, and min_tokens forbids that.
    r = constrained(compiler, CHOICE, temperature=0, min_tokens=5, max_tokens=8)
    for t in tok.encode("yes"):
        r.append_token(t)
    free = Request("f", [1], SamplingParams(temperature=0), (2,))
    out = Sampler()(torch.randn(2, tok.vocab_size), [r, free])
    assert set(out.errors) == {0} and "no token can continue" in out.errors[0]


def test_a_complete_grammar_stops_the_request_before_min_tokens(compiler):
    r = constrained(compiler, CHOICE, temperature=0, min_tokens=5, max_tokens=8)
    for t in default_tokenizer().encode("no"):
        r.append_token(t)
    assert r.check_stop(max_model_len=1000) is RequestStatus.FINISHED_STOPPED


def test_grammar_failure_in_the_mask_is_an_error_row(compiler):
    tok = default_tokenizer()
    r = constrained(compiler, StructuredOutput("regex", "[^\\x00-\\x{10FFFF}]"), temperature=0)
    free = Request("f", [1], SamplingParams(temperature=0), (2,))
    out = Sampler()(torch.randn(2, tok.vocab_size), [r, free])
    assert set(out.errors) == {0} and "structured output failed" in out.errors[0]


# --- the engine --------------------------------------------------------------------------------


def test_json_schema_output_validates_and_stops(llm):
    sp = SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    out = llm.generate("Describe a person.", sp, use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_choice_ends_with_stop_once_complete(llm):
    outs = llm.generate(["a", "b", "c"], SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                                                         structured=CHOICE), use_tqdm=False)
    assert {o.text for o in outs} <= {"yes", "no"}
    assert all(o.finish_reason == "stop" for o in outs)


def test_unsatisfiable_grammar_ends_with_an_error_not_at_max_tokens(llm):
    bad = SamplingParams(temperature=0, max_tokens=50, structured=StructuredOutput("regex", "[^\\x00-\\x{10FFFF}]"))
    good = SamplingParams(temperature=0, max_tokens=5)
    outs = llm.generate(["x", "y"], [bad, good], use_tqdm=False)
    assert outs[0].finish_reason == "error" and outs[0].token_ids == []
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 5


def run_to_end(engine) -> dict[str, list]:
    """Step until the engine holds nothing; every output by request id."""
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_a_bad_constraint_is_rejected_by_the_engine_not_raised_past_it(llm):
    # Compiled off the loop: the rejection is the request's own error output, not an exception.
    bad = SamplingParams(max_tokens=5, structured=StructuredOutput("regex", "(unclosed"))
    llm.engine.add_request("bad", [1, 2, 3], bad)
    (out,) = run_to_end(llm.engine)["bad"]
    assert out.finish_reason == "error" and out.error.startswith("structured: invalid structured output")
    assert not llm.engine.has_unfinished()


def test_a_constraint_compiles_off_the_engine_loop_while_other_requests_run(llm, monkeypatch):
    engine = llm.engine
    release = threading.Event()
    compile_ = engine.grammars.compile

    def slow_compile(spec):  # a compile that lasts until the test says so
        release.wait(30)
        return compile_(spec)

    monkeypatch.setattr(engine.grammars, "compile", slow_compile)
    engine.add_request("free", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    spec = StructuredOutput("regex", "[0-9]{3}")  # not compiled before in this module
    engine.add_request("held", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8, structured=spec))
    tokens: dict[str, int] = {}
    for _ in range(4):  # the unconstrained request runs to its end while the other compiles
        for o in engine.step():
            tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.new_token_ids)
    assert tokens == {"free": 4} and "held" in engine.scheduler.compiling
    release.set()
    outs = run_to_end(engine)["held"]
    assert outs[-1].finish_reason == "stop" and sum(len(o.new_token_ids) for o in outs) == 3


def test_a_request_aborted_while_compiling_ends_and_frees_nothing_twice(llm, monkeypatch):
    engine = llm.engine
    release = threading.Event()
    compile_ = engine.grammars.compile
    monkeypatch.setattr(engine.grammars, "compile", lambda spec: (release.wait(30), compile_(spec))[1])
    spec = StructuredOutput("regex", "[a-c]{2}")
    engine.add_request("gone", [1, 2], SamplingParams(max_tokens=4, structured=spec))
    assert [o.finish_reason for o in engine.abort(["gone"])] == ["abort"]
    release.set()
    assert not engine.has_unfinished() and run_to_end(engine) == {}


def test_resuming_from_generated_tokens_continues_exactly(llm):
    """What the decode worker does: rebuild the matcher from the prefill worker's tokens."""
    sp = SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    prompt = llm.encode_prompt("Describe a person.")
    full = llm.generate(prompt, sp, use_tqdm=False)[0].token_ids
    assert len(full) > 3
    engine = llm.engine
    for k in (1, 3):
        engine.add_request(f"resume-{k}", prompt, sp, output_token_ids=full[:k])
        tokens: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids
        assert full[:k] + tokens == full


def test_tokens_off_the_grammar_are_refused_on_resume(llm):
    sp = SamplingParams(temperature=0, max_tokens=10, structured=StructuredOutput("regex", "[0-9]+"))
    llm.engine.add_request("off", [1, 2], sp, output_token_ids=default_tokenizer().encode("abc"))
    (out,) = run_to_end(llm.engine)["off"]  # compiled off the loop: refused when it is ready
    assert out.finish_reason == "error" and out.error.startswith("output_token_ids: ")
    # Compiled before (a cache hit): refused at once, as a rejection of the request.
    with pytest.raises(RequestRejected) as err:
        llm.engine.add_request("off2", [1, 2], sp, output_token_ids=default_tokenizer().encode("abc"))
    assert err.value.param == "output_token_ids"
