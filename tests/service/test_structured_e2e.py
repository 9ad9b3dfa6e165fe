"""Structured outputs end to end: real router and workers (disaggregated and colocated), the
official `openai` client, the tiny random Llama. A random model writes noise, so whatever it
returns parses and validates only because the grammar held, across the P->D hand-off too."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.helpers.service_harness import Cluster

pytestmark = pytest.mark.timeout(400)

CHAT = [{"role": "user", "content": "Reply in JSON."}]
MAX_TOKENS = 120

# Each schema's language is finite or its shortest completions are short, so the grammar ends
# the answer well within MAX_TOKENS even when a random model picks the tokens.
INT09 = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMAS: list[dict] = [
    {"type": "boolean"},
    INT09,
    {"enum": ["red", "green", "blue"]},
    {"type": "string", "maxLength": 5},
    {"type": "null"},
    {"const": "fixed"},
    {"type": "object", "properties": {"n": INT09}, "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": INT09, "y": INT09},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"flag": {"type": "boolean"}}, "additionalProperties": False},
    {"anyOf": [INT09, {"type": "boolean"}]},
    {"type": "string", "pattern": "^[a-z]{2,4}$"},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
    {"type": "array", "prefixItems": [INT09, {"type": "boolean"}], "items": False, "minItems": 2},
    {"$defs": {"small": {"type": "integer", "minimum": 1, "maximum": 5}}, "type": "object",
     "properties": {"v": {"$ref": "#/$defs/small"}}, "required": ["v"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 2,
     "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"],
               "additionalProperties": False}},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 3},
    {"enum": ["café", "naïve", 3, None]},
]
assert len({json.dumps(s, sort_keys=True) for s in SCHEMAS}) == 20


def start(tmp_path_factory, name: str, **kw) -> Cluster:
    # The prefill worker takes the router's requests one by one; a short request timeout would
    # only hide a stall, so the default stays.
    return Cluster(tmp_path_factory.mktemp(name), kw.pop("model"), **kw).start()


@pytest.fixture(scope="module")
def disagg(tiny_dir, tmp_path_factory):
    cluster = start(tmp_path_factory, "so-disagg", model=str(tiny_dir), transport="tcp")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def colocated(tiny_dir, tmp_path_factory):
    cluster = start(tmp_path_factory, "so-colo", model=str(tiny_dir), mode="colocated")
    yield cluster
    cluster.stop()


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model_name(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def ask(c: openai.OpenAI, model: str, schema: dict, stream: bool) -> tuple[str, str, list]:
    """(content, finish_reason, tokens as byte lists) of one greedy json_schema request."""
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    if not stream:
        r = c.chat.completions.create(model=model, messages=CHAT, response_format=rf, temperature=0,
                                      max_tokens=MAX_TOKENS, logprobs=True)
        ch = r.choices[0]
        return ch.message.content, ch.finish_reason, [t.bytes for t in ch.logprobs.content]
    text, finish = [], None
    for chunk in c.chat.completions.create(model=model, messages=CHAT, response_format=rf, temperature=0,
                                           max_tokens=MAX_TOKENS, stream=True):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish, []


def answers(cluster: Cluster, stream: bool) -> list[tuple[str, str, list]]:
    c = client(cluster)
    model = model_name(c)
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda s: ask(c, model, s, stream), SCHEMAS))


@pytest.fixture(scope="module")
def results(disagg, colocated):
    return {(mode, stream): answers(cluster, stream)
            for mode, cluster in (("disaggregated", disagg), ("colocated", colocated))
            for stream in (False, True)}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_twenty_schemas_each_return_json_that_validates(results, mode, stream):
    for schema, (content, finish, _) in zip(SCHEMAS, results[mode, stream], strict=True):
        assert finish == "stop", (schema, content)
        jsonschema.validate(json.loads(content), schema)


def test_disaggregated_equals_colocated_token_for_token(results):
    disagg = results["disaggregated", False]
    colo = results["colocated", False]
    for schema, (d_text, _, d_tokens), (c_text, _, c_tokens) in zip(SCHEMAS, disagg, colo, strict=True):
        assert d_tokens == c_tokens and d_text == c_text, schema
    assert [r[0] for r in results["disaggregated", True]] == [r[0] for r in disagg]  # streaming too


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_guided_regex_and_choice_hold(request, mode):
    c = client(request.getfixturevalue("disagg" if mode == "disaggregated" else "colocated"))
    model = model_name(c)
    for seed in range(3):
        r = c.completions.create(model=model, prompt="Call me at", max_tokens=40, temperature=1.0, seed=seed,
                                 extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
        assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
        r = c.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=1.0, seed=seed,
                                      extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
        assert r.choices[0].message.content in {"alpha", "beta", "gamma"}
    r = c.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": 'start: "x" ("y" | "z")'}})
    assert r.choices[0].message.content in {"xy", "xz"}


def test_invalid_schema_and_regex_are_400_and_the_next_request_succeeds(disagg):
    c = client(disagg)
    model = model_name(c)
    bad = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
        {"extra_body": {"guided_regex": "(unclosed"}},
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=model, messages=CHAT, max_tokens=10, **kw)
        assert err.value.body["param"] in ("response_format", "guided_regex")
        r = c.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0,
                                      response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}})
        assert r.choices[0].message.content in ("true", "false")
