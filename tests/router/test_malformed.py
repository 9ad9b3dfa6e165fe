"""A table of malformed requests: each gets its 4xx with the OpenAI envelope, and a normal
request right after it still succeeds (nothing a bad request does outlives it)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from pdserve.router.http_server import EdgeLimits
from tests.helpers.fake_worker import RouterHarness

pytestmark = pytest.mark.timeout(60)

OK_CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
OK_COMP = {"model": "fake-model", "prompt": "hi", "max_tokens": 5}
USER = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}
_DROP = object()


def chat(**changes) -> dict:
    return {k: v for k, v in {**OK_CHAT, **changes}.items() if v is not _DROP}


def comp(**changes) -> dict:
    return {k: v for k, v in {**OK_COMP, **changes}.items() if v is not _DROP}


C, P = "/v1/chat/completions", "/v1/completions"

# (id, path, json body or raw bytes body, extra headers, status, param, code)
CASES = [
    # --- not JSON, or not an object
    ("truncated json", C, b'{"model": ', JSON, 400, None, None),
    ("not utf-8", P, b"\xff\xfe\x00", JSON, 400, None, None),
    ("empty body", C, b"", JSON, 400, None, None),
    ("json array", C, b"[1, 2]", JSON, 400, None, None),
    ("json string", C, b'"hi"', JSON, 400, None, None),
    ("json null", P, b"null", JSON, 400, None, None),
    ("NaN literal", C, b'{"model": "fake-model", "temperature": NaN, "messages": []}', JSON, 400, None, None),
    ("trailing garbage", C, json.dumps(OK_CHAT).encode() + b"}}", JSON, 400, None, None),
    # --- missing or wrongly typed fields
    ("no messages", C, chat(messages=_DROP), None, 400, "messages", None),
    ("no model", C, chat(model=_DROP), None, 400, "model", None),
    ("empty model", C, chat(model=""), None, 400, "model", None),
    ("model not a string", C, chat(model=7), None, 400, "model", None),
    ("messages a string", C, chat(messages="hi"), None, 400, "messages", None),
    ("messages empty", C, chat(messages=[]), None, 400, "messages", None),
    ("message not an object", C, chat(messages=["hi"]), None, 400, "messages[0]", None),
    ("message without role", C, chat(messages=[{"content": "x"}]), None, 400, "messages[0].role", None),
    ("unknown role", C, chat(messages=[{"role": "wizard", "content": "x"}]), None, 400, "messages[0].role", None),
    ("content a number", C, chat(messages=[{"role": "user", "content": 5}]), None, 400, "messages[0].content", None),
    ("content null", C, chat(messages=[{"role": "user", "content": None}]), None, 400, "messages[0].content", None),
    ("content missing", C, chat(messages=[{"role": "system"}]), None, 400, "messages[0].content", None),
    ("image part", C, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None, 400, "messages[0].content[0]", None),
    ("part without type", C, chat(messages=[{"role": "user", "content": [{"text": "x"}]}]), None, 400, "messages[0].content[0].type", None),
    ("tool_calls in history without a function", C, chat(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]), None, 400, "messages[1].tool_calls[0].function", None),
    ("tool message without tool_call_id", C, chat(messages=[*USER, {"role": "tool", "content": "42"}]), None, 400, "messages[1].tool_call_id", None),
    ("max_tokens a string", C, chat(max_tokens="5"), None, 400, "max_tokens", None),
    ("max_tokens a float", C, chat(max_tokens=5.5), None, 400, "max_tokens", None),
    ("max_tokens a bool", C, chat(max_tokens=True), None, 400, "max_tokens", None),
    ("temperature a string", C, chat(temperature="hot"), None, 400, "temperature", None),
    ("top_p a list", C, chat(top_p=[1]), None, 400, "top_p", None),
    ("stream a string", C, chat(stream="yes"), None, 400, "stream", None),
    ("stop a number", C, chat(stop=5), None, 400, "stop", None),
    ("stop list of numbers", C, chat(stop=[1]), None, 400, "stop[0]", None),
    ("n a string", C, chat(n="2"), None, 400, "n", None),
    ("seed a string", C, chat(seed="x"), None, 400, "seed", None),
    ("seed over 64 bits", C, chat(seed=2**70), None, 400, "seed", None),
    ("stop_token_ids strings", C, chat(stop_token_ids=["a"]), None, 400, "stop_token_ids[0]", None),
    ("logprobs a number (chat)", C, chat(logprobs=3), None, 400, "logprobs", None),
    ("stream_options a string", C, chat(stream=True, stream_options="x"), None, 400, "stream_options", None),
    ("chat_template_kwargs a list", C, chat(chat_template_kwargs=[1]), None, 400, "chat_template_kwargs", None),
    ("response_format unknown type", C, chat(response_format={"type": "xml"}), None, 400, "response_format", None),
    ("response_format json_schema without it", C, chat(response_format={"type": "json_schema"}), None, 400, "response_format", None),
    ("guided_json a number", C, chat(guided_json=5), None, 400, "guided_json", None),
    ("guided_regex a list", P, comp(guided_regex=["a"]), None, 400, "guided_regex", None),
    ("guided_choice a string", P, comp(guided_choice="yes"), None, 400, "guided_choice", None),
    ("structured_outputs unknown key", C, chat(structured_outputs={"structural_tag": {}}), None, 400, "structured_outputs", None),
    ("two constraints", C, chat(guided_regex="a", guided_choice=["a"]), None, 400, "guided_choice", None),
    # --- out of range
    ("temperature too high", C, chat(temperature=3.5), None, 400, "temperature", None),
    ("temperature negative", C, chat(temperature=-1), None, 400, "temperature", None),
    ("temperature infinite", C, b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', JSON, 400, "temperature", None),
    ("top_p zero", C, chat(top_p=0), None, 400, "top_p", None),
    ("top_p over one", C, chat(top_p=1.5), None, 400, "top_p", None),
    ("top_k negative", C, chat(top_k=-5), None, 400, "top_k", None),
    ("min_p over one", C, chat(min_p=2), None, 400, "min_p", None),
    ("presence_penalty high", C, chat(presence_penalty=9), None, 400, "presence_penalty", None),
    ("frequency_penalty low", C, chat(frequency_penalty=-9), None, 400, "frequency_penalty", None),
    ("repetition_penalty zero", C, chat(repetition_penalty=0), None, 400, "repetition_penalty", None),
    ("max_tokens zero", C, chat(max_tokens=0), None, 400, "max_tokens", None),
    ("max_tokens negative", C, chat(max_tokens=-3), None, 400, "max_tokens", None),
    ("max_completion_tokens zero", C, chat(max_completion_tokens=0), None, 400, "max_completion_tokens", None),
    ("max_tokens over context", C, chat(max_tokens=10_000), None, 400, "messages", "context_length_exceeded"),
    ("min_tokens over max", C, chat(min_tokens=9), None, 400, "min_tokens", None),
    ("n zero", C, chat(n=0), None, 400, "n", None),
    ("n too many", C, chat(n=99), None, 400, "n", None),
    ("too many stops", C, chat(stop=["a", "b", "c", "d", "e"]), None, 400, "stop", None),
    ("empty stop", C, chat(stop=[""]), None, 400, "stop", None),
    ("top_logprobs too many", C, chat(logprobs=True, top_logprobs=50), None, 400, "top_logprobs", None),
    ("top_logprobs without logprobs", C, chat(top_logprobs=2), None, 400, "top_logprobs", None),
    ("stop_token_ids outside vocab", C, chat(stop_token_ids=[99999]), None, 400, "stop_token_ids", None),
    ("stream_options without stream", C, chat(stream_options={"include_usage": True}), None, 400, "stream_options", None),
    ("prompt over context", C, chat(messages=[{"role": "user", "content": "x" * 80}]), None, 400, "messages", "context_length_exceeded"),
    # --- fields pdserve does not honour
    # --- tools (the rest of their checks: tests/router/test_tools.py)
    ("tool not a function", C, chat(tools=[{"type": "code_interpreter"}]), None, 400, "tools[0].type", None),
    ("tool name with spaces", C, chat(tools=[{"type": "function", "function": {"name": "f g"}}]), None, 400, "tools[0].function.name", None),
    ("tool_choice auto without tools", C, chat(tool_choice="auto"), None, 400, "tool_choice", None),
    ("tool_choice named without tools", C, chat(tool_choice={"type": "function", "function": {"name": "f"}}), None, 400, "tool_choice", None),
    ("parallel_tool_calls without tools", C, chat(parallel_tool_calls=True), None, 400, "parallel_tool_calls", None),
    ("functions", C, chat(functions=[{"name": "f"}]), None, 400, "functions", "unsupported_parameter"),
    ("function_call", C, chat(function_call="auto"), None, 400, "function_call", "unsupported_parameter"),
    ("chat_template", C, chat(chat_template="{{ messages }}"), None, 400, "chat_template", "unsupported_parameter"),
    ("logit_bias", C, chat(logit_bias={"5": 10}), None, 400, "logit_bias", "unsupported_parameter"),
    ("audio modality", C, chat(modalities=["text", "audio"]), None, 400, "modalities", "unsupported_parameter"),
    ("best_of", P, comp(best_of=3), None, 400, "best_of", "unsupported_parameter"),
    ("use_beam_search", P, comp(use_beam_search=True), None, 400, "use_beam_search", "unsupported_parameter"),
    ("echo", P, comp(echo=True), None, 400, "echo", None),
    ("suffix", P, comp(suffix="x"), None, 400, "suffix", None),
    # --- completions prompt
    ("prompt missing", P, comp(prompt=_DROP), None, 400, "prompt", None),
    ("prompt empty", P, comp(prompt=""), None, 400, "prompt", None),
    ("prompt a number", P, comp(prompt=5), None, 400, "prompt", None),
    ("prompt mixed list", P, comp(prompt=[1, "a"]), None, 400, "prompt", None),
    ("prompt batch of two", P, comp(prompt=[[1], [2]]), None, 400, "prompt", None),
    ("prompt negative id", P, comp(prompt=[-1]), None, 400, "prompt", None),
    ("prompt id outside vocab", P, comp(prompt=[10**6]), None, 400, "prompt", None),
    ("completion logprobs too many", P, comp(logprobs=50), None, 400, "logprobs", None),
    # --- model, route, method, size, headers
    ("unknown model", C, chat(model="gpt-9"), None, 404, "model", "model_not_found"),
    ("unknown route", "/v1/nothing", OK_CHAT, None, 404, None, "not_found"),
    ("oversized body", C, chat(messages=[{"role": "user", "content": "x" * 5000}]), None, 413, None, "body_too_large"),
    ("content-length not a number", C, json.dumps(OK_CHAT).encode(), {"content-length": "abc", **JSON}, 400, None, None),
]


@pytest.fixture(scope="module")
def router():
    edge = EdgeLimits(header_timeout=2.0, body_timeout=2.0, max_header_bytes=8192)
    with RouterHarness(max_body_bytes=4096, edge=edge) as h:
        h.worker("colo-0", max_model_len=64)
        yield h


@pytest.fixture(scope="module")
def http(router):
    with httpx.Client(base_url=router.base_url, timeout=10) as c:
        yield c


def check_envelope(status: int, body: bytes, want: int, param: str | None, code: str | None) -> None:
    assert status == want, body[:300]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def send_raw(router, head: bytes, body: bytes) -> tuple[int, bytes]:
    """One request written by hand (httpx would fix up a bad Content-Length)."""
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(head + body)
        s.settimeout(5)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head_out, _, body_out = out.partition(b"\r\n\r\n")
    return int(head_out.split()[1]), body_out


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param", "code"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_malformed_request_gets_its_4xx_envelope_and_the_next_one_succeeds(
    router, http, path, body, headers, status, param, code
):
    if headers is not None and "content-length" in headers:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        head += f"content-length: {headers['content-length']}\r\nconnection: close\r\n\r\n"
        got, payload = send_raw(router, head.encode(), body)
    elif isinstance(body, bytes):
        r = http.post(path, content=body, headers=headers)
        got, payload = r.status_code, r.content
    else:
        r = http.post(path, json=body)
        got, payload = r.status_code, r.content
    check_envelope(got, payload, status, param, code)
    assert http.post(C, json=OK_CHAT).status_code == 200
    assert router.service.inflight == 0


def test_the_table_is_large_enough():
    assert len(CASES) >= 60
