"""The chat page's files as the router serves them, and the route it reads from each answer: the
x-pdserve-* headers and the stream's closing `: pdserve served-by` comment (router/served_by.py).
Scripted workers; the page in a browser is tests/router/test_chat_page_browser.py."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import httpx
import openai
import pytest

from tests.helpers.fake_worker import RouterHarness, toks
from tests.helpers.paths import REPO

pytestmark = pytest.mark.timeout(60)

STATIC = REPO / "router" / "static"
TEXT = "Hello world, the END is near"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".svg": "image/svg+xml"}


class PageParser(HTMLParser):
    """What a CSP check needs from the HTML: assets, scripts, inline handlers and styles."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.scripts: list[dict[str, str | None]] = []
        self.inline: list[str] = []  # on* handlers, style attributes, <style> elements
        self._in_script = False
        self.script_text = ""

    def handle_starttag(self, tag, attrs):
        attrs_d = dict(attrs)
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]
        self.inline += [f"<{tag} {k}>" for k, _ in attrs if k.startswith("on") or k == "style"]
        if tag == "style":
            self.inline.append("<style>")
        if tag == "script":
            self.scripts.append(attrs_d)
            self._in_script = True

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.script_text += data.strip()


def parsed_page(html: str) -> PageParser:
    p = PageParser()
    p.feed(html)
    return p


def csp_directives(value: str) -> dict[str, list[str]]:
    out = {}
    for part in value.split(";"):
        name, *sources = part.split()
        out[name] = sources
    return out


def assert_envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def served_comment(lines: list[str]) -> dict:
    """The closing comment's JSON; it comes right before `data: [DONE]`."""
    events = [ln for ln in lines if ln]
    assert events[-1] == "data: [DONE]"
    prefix = ": pdserve served-by "
    assert events[-2].startswith(prefix) and events[-2].isascii(), events[-3:]
    assert sum(ln.startswith(":") for ln in events) == 1
    return json.loads(events[-2][len(prefix):])


def stream_lines(c: httpx.Client, body: dict) -> tuple[httpx.Headers, list[str]]:
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return r.headers, list(r.iter_lines())


def first_chunk_id(lines: list[str]) -> str:
    return json.loads(next(ln for ln in lines if ln.startswith("data: {"))[6:])["id"]


# --- the page --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def router():
    with RouterHarness() as h:
        h.worker("colo-0", script=toks(TEXT))
        yield h


@pytest.mark.parametrize("path", ["/", "/chat"])
def test_the_page_is_served_as_html_under_a_strict_content_security_policy(router, path):
    r = httpx.get(router.base_url + path)
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>pdserve chat</title>" in r.text
    csp = csp_directives(r.headers["content-security-policy"])
    assert csp["default-src"] == ["'self'"] and csp["script-src"] == ["'self'"]
    assert csp["connect-src"] == ["'self'"] and csp["style-src"] == ["'self'"]
    assert csp["object-src"] == ["'none'"] and csp["frame-ancestors"] == ["'none'"]
    assert r.headers["x-content-type-options"] == "nosniff"


def test_every_asset_the_page_names_comes_from_the_router_with_its_content_type(router):
    page = parsed_page(httpx.get(router.base_url + "/").text)
    # Relative to the page (which is at the root), so a path prefix in front of the router works.
    assert page.refs and all(ref.startswith("static/") for ref in page.refs), page.refs
    for ref in page.refs:
        r = httpx.get(f"{router.base_url}/{ref}")
        name = ref.removeprefix("static/")
        assert r.status_code == 200, ref
        assert r.headers["content-type"] == TYPES[Path(name).suffix], ref
        assert r.content == (STATIC / name).read_bytes()
        assert "default-src 'self'" in r.headers["content-security-policy"]


def test_the_page_has_no_inline_script_or_style_and_names_no_other_origin():
    html = (STATIC / "chat.html").read_text()
    page = parsed_page(html)
    assert [s.get("src") for s in page.scripts] == ["static/chat.js"] and page.script_text == ""
    assert page.inline == []
    for name in ("chat.html", "chat.js", "chat.css"):
        assert not re.search(r"https?://|url\(", (STATIC / name).read_text()), name


def test_the_page_is_served_without_the_api_key_and_holds_no_secret():
    key = "s3cret-key-of-this-router"
    with RouterHarness(api_key=key) as h, httpx.Client(base_url=h.base_url) as c:
        h.worker("colo-0", script=toks(TEXT))
        page = c.get("/")
        assert page.status_code == 200
        bodies = [page.text] + [c.get("/" + ref).text for ref in parsed_page(page.text).refs]
        assert all(key not in b for b in bodies)
        assert_envelope(c.post("/v1/chat/completions", json=CHAT), 401)  # the API still needs it


@pytest.mark.parametrize("method,path", [("POST", "/"), ("PUT", "/chat"), ("DELETE", "/static/chat.js")])
def test_the_page_routes_take_get_only_and_refuse_others_with_405_enveloped(router, method, path):
    err = assert_envelope(httpx.request(method, router.base_url + path), 405)
    assert err["code"] == "method_not_allowed"


@pytest.mark.parametrize("path", ["/static/nope.js", "/static/chat.html", "/static/..%2Fapp.py",
                                  "/static/../app.py", "/static/"])
def test_only_the_page_assets_are_served_and_anything_else_is_404_enveloped(router, path):
    assert_envelope(httpx.get(router.base_url + path), 404)


# --- the route of each answer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def two_pairs():
    with RouterHarness() as h:
        for i in range(2):
            h.worker(f"prefill-{i}", "prefill", script=toks(TEXT))
            h.worker(f"decode-{i}", "decode", script=toks(TEXT))
        yield h


def true_route(h: RouterHarness, sub_id: str) -> tuple[str, str]:
    """(prefill, decode) of a sub-request, as the prefill worker that got it was told."""
    got = [(w.worker_id, m.decode_worker_id) for w in h.workers for m in w.requests()
           if m.request_id == sub_id]
    assert len(got) == 1, got
    return got[0]


def test_an_answer_names_the_prefill_and_decode_workers_that_served_it(two_pairs):
    h = two_pairs
    with httpx.Client(base_url=h.base_url, timeout=10) as c:
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            route = true_route(h, r.json()["id"] + "-0")
            assert r.headers["x-pdserve-mode"] == "disaggregated"
            assert (r.headers["x-pdserve-prefill-worker"], r.headers["x-pdserve-decode-worker"]) == route
            headers, lines = stream_lines(c, CHAT)
            route = true_route(h, first_chunk_id(lines) + "-0")
            assert (headers["x-pdserve-prefill-worker"], headers["x-pdserve-decode-worker"]) == route
            final = served_comment(lines)["choices"]
            assert final == [{"index": 0, "mode": "disaggregated", "prefill": route[0],
                              "decode": route[1], "migrations": 0}]


def test_n_choices_list_their_workers_in_index_order(two_pairs):
    h = two_pairs
    with httpx.Client(base_url=h.base_url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "n": 3})
        routes = [true_route(h, f"{r.json()['id']}-{i}") for i in range(3)]
        assert r.headers["x-pdserve-prefill-worker"].split(",") == [p for p, _ in routes]
        assert r.headers["x-pdserve-decode-worker"].split(",") == [d for _, d in routes]
        assert r.headers["x-pdserve-mode"] == "disaggregated,disaggregated,disaggregated"


def test_a_colocated_answer_names_its_one_worker_as_both(router):
    with httpx.Client(base_url=router.base_url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.headers["x-pdserve-mode"] == "colocated"
        assert r.headers["x-pdserve-prefill-worker"] == r.headers["x-pdserve-decode-worker"] == "colo-0"
        headers, lines = stream_lines(c, CHAT)
        assert headers["x-pdserve-decode-worker"] == "colo-0"
        assert served_comment(lines)["choices"][0]["decode"] == "colo-0"


def test_a_migrated_stream_names_its_first_workers_in_headers_and_its_final_ones_at_the_end():
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        h.worker("prefill-0", "prefill", script=toks(TEXT), first_delay=0.3)
        h.worker("decode-0", "decode", script=toks(TEXT), kv_refuse=1000)
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.headers["x-pdserve-decode-worker"] == "decode-0"
            h.worker("decode-1", "decode", script=toks(TEXT))  # where the failed hand-off goes
            lines = list(r.iter_lines())
        text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
                       for ln in lines if ln.startswith("data: {") and json.loads(ln[6:])["choices"])
        assert text == TEXT
        assert served_comment(lines)["choices"] == [
            {"index": 0, "mode": "disaggregated", "prefill": "prefill-0", "decode": "decode-1",
             "migrations": 1}
        ]


def test_a_worker_id_outside_the_safe_characters_is_percent_encoded_in_headers():
    odd = "colo 0,é\u2028"
    with RouterHarness() as h, httpx.Client(base_url=h.base_url, timeout=10) as c:
        h.worker(odd, script=toks(TEXT))
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        encoded = r.headers["x-pdserve-prefill-worker"]
        assert encoded.isascii() and "," not in encoded and unquote(encoded) == odd
        _, lines = stream_lines(c, CHAT)
        assert served_comment(lines)["choices"][0]["prefill"] == odd


def test_the_openai_client_reads_the_stream_past_the_closing_comment_and_sees_the_headers(two_pairs):
    client = openai.OpenAI(base_url=two_pairs.base_url + "/v1", api_key="x", max_retries=0, timeout=20)
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=CHAT["messages"], max_tokens=50, stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers["x-pdserve-prefill-worker"].startswith("prefill-")
    chunks = list(raw.parse())
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == TEXT
    assert chunks[-1].usage.completion_tokens == len(toks(TEXT))
