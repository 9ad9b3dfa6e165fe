"""The chat page in a real headless Chromium (Debian's chromium + chromium-driver under selenium).

The first test runs a real deployment (router, prefill and decode processes with the tiny random
Llama): the page's streamed answers, turn after turn, equal what the API answers for the same
conversation. The others use scripted workers to pin down the route shown, Stop, the API key and
error display. Without Chromium they fail, saying what to install: they never skip.
(docs/chat_page.png is made by tests/helpers/chat_screenshot.py, with the real SmolLM2.)
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.browser import find_chromium, headless_chromium
from tests.helpers.fake_worker import FakeTokenizer, RouterHarness, toks
from tests.helpers.service_harness import Cluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # a real deployment and a browser

TEXT = "Hello world, the END is near"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def browser():
    found = find_chromium()
    if isinstance(found, str):  # never a skip: a missing browser would hide a broken page
        pytest.fail(f"the chat page's browser test needs Chromium: {found}. Install Debian's chromium and "
                    "chromium-driver (.ci/run does, as root)")
    driver = headless_chromium(*found)
    yield driver
    driver.quit()


# --- driving the page ------------------------------------------------------------------------


def wait(driver, predicate, timeout: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: predicate(d))


def open_page(driver, url: str, ready: bool = True) -> None:
    driver.get(url)
    driver.get_log("browser")  # what earlier pages logged is not this page's
    if ready:
        wait(driver, lambda d: status(d) == "ready")


def status(driver) -> str:
    return driver.find_element("id", "status").text


def set_field(driver, element_id: str, value) -> None:
    el = driver.find_element("id", element_id)
    el.clear()
    el.send_keys(str(value))


def ask(driver, question: str, temperature: float = 0, max_tokens: int = MAX_TOKENS) -> None:
    set_field(driver, "temperature", temperature)
    set_field(driver, "max-tokens", max_tokens)
    set_field(driver, "prompt", question)
    driver.find_element("id", "send").click()


def answers(driver) -> list[dict]:
    """Every assistant message as the page holds it: text, state, data-* fields, error, meta."""
    return driver.execute_script("""
        return [...document.querySelectorAll('.message.assistant')].map(el => ({
            text: el.querySelector('.content').textContent,
            state: el.dataset.state,
            data: {...el.dataset},
            error: el.querySelector('.error') ? el.querySelector('.error').textContent : null,
            meta: el.querySelector('.meta').textContent,
            excluded: el.classList.contains('excluded'),
        }));""")


def answer(driver, number: int, timeout: float = 60.0) -> dict:
    """The `number`-th answer (1-based) once it is no longer streaming."""
    wait(driver, lambda d: len(answers(d)) >= number and answers(d)[number - 1]["state"] != "streaming",
         timeout)
    return answers(driver)[number - 1]


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


# --- a real deployment -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("chat-page"), str(tiny_dir)).start()
    yield c
    c.stop()


def test_the_streamed_answers_equal_the_api_answers_turn_after_turn(browser, cluster):
    open_page(browser, cluster.base_url + "/")
    model = httpx.get(cluster.base_url + "/v1/models").json()["data"][0]["id"]
    assert browser.find_element("id", "model").text == model
    api = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    conversation = []
    for turn, question in enumerate(["Name three colours of the rainbow.", "And three more?"], 1):
        ask(browser, question)
        shown = answer(browser, turn)
        assert shown["state"] == "done", shown
        conversation.append({"role": "user", "content": question})
        raw = api.chat.completions.with_raw_response.create(
            model=model, messages=conversation, temperature=0, top_p=1, max_tokens=MAX_TOKENS)
        reply = raw.parse()
        assert shown["text"] == reply.choices[0].message.content and shown["text"]
        conversation.append({"role": "assistant", "content": shown["text"]})
        # Who served it: the route the API names, and the cluster's only pair.
        assert (shown["data"]["prefill"], shown["data"]["decode"]) == (
            raw.headers["x-pdserve-prefill-worker"], raw.headers["x-pdserve-decode-worker"]
        ) == ("prefill-0", "decode-0")
        assert "served by prefill-0 → decode-0" in shown["meta"]
        # Its timings: a TTFT, and the token count the stream's usage gave.
        assert int(shown["data"]["tokens"]) == reply.usage.completion_tokens
        assert f"{reply.usage.completion_tokens} tokens" in shown["meta"]
        assert float(shown["data"]["ttftMs"]) >= 0 and "TTFT" in shown["meta"]
        assert "tok/s" in shown["meta"] or reply.usage.completion_tokens == 1
    assert console_errors(browser) == []  # no CSP violation, no missing asset


# --- scripted workers ------------------------------------------------------------------------


def test_the_workers_shown_are_the_ones_the_request_went_to(browser):
    with RouterHarness() as h:
        for i in range(2):
            h.worker(f"prefill-{i}", "prefill", script=toks(TEXT))
            h.worker(f"decode-{i}", "decode", script=toks(TEXT))
        open_page(browser, h.base_url + "/chat")
        for turn in range(1, 4):
            ask(browser, f"question {turn}", max_tokens=50)
            shown = answer(browser, turn)
            assert shown["state"] == "done" and shown["text"] == TEXT
            sub_id = shown["data"]["requestId"] + "-0"
            (route,) = [(w.worker_id, m.decode_worker_id) for w in h.workers for m in w.requests()
                        if m.request_id == sub_id]
            assert (shown["data"]["prefill"], shown["data"]["decode"]) == route
            assert f"served by {route[0]} → {route[1]}" in shown["meta"]


def test_stop_ends_the_stream_aborts_the_request_on_the_worker_and_keeps_the_partial_answer(browser):
    with RouterHarness() as h:
        w = h.worker("colo-0", script=toks("Hello world") * 200, delay=0.05)
        open_page(browser, h.base_url + "/")
        ask(browser, "talk", max_tokens=800)
        wait(browser, lambda d: len(answers(d)) == 1 and answers(d)[0]["text"].startswith("Hello wor"))
        browser.find_element("id", "stop").click()
        stopped = answer(browser, 1)
        assert stopped["state"] == "stopped" and "stopped" in stopped["meta"]
        sub_id = stopped["data"]["requestId"] + "-0"
        assert w.wait_for(lambda: sub_id in w.aborted, timeout=3)
        assert browser.find_element("id", "send").is_enabled()
        assert not browser.find_element("id", "stop").is_enabled()
        assert answers(browser)[0]["text"] == stopped["text"]  # nothing arrives after the stop
        # The partial answer stays in the conversation: the next question carries it.
        ask(browser, "again", max_tokens=800)
        assert w.wait_for(lambda: len(w.requests()) == 2)
        prompt = FakeTokenizer().decode(w.requests()[1].token_ids)
        assert prompt == f"<user>talk\n<assistant>{stopped['text']}\n<user>again\n<assistant>"
        browser.find_element("id", "stop").click()
        assert answer(browser, 2)["state"] == "stopped"


def test_with_an_api_key_the_page_asks_for_it_refuses_a_wrong_one_and_works_with_the_right(browser):
    with RouterHarness(api_key="s3cret") as h:
        w = h.worker("colo-0", script=toks(TEXT))
        open_page(browser, h.base_url + "/", ready=False)
        wait(browser, lambda d: d.find_element("id", "key-form").is_displayed())
        assert status(browser) == "an API key is required"
        set_field(browser, "api-key", "wrong")
        browser.find_element("id", "key-save").click()
        wait(browser, lambda d: d.find_element("id", "key-error").is_displayed())
        refused = browser.find_element("id", "key-error").text
        assert "401" in refused and "invalid_api_key" in refused
        set_field(browser, "api-key", "s3cret")
        browser.find_element("id", "key-save").click()
        wait(browser, lambda d: status(d) == "ready")
        assert not browser.find_element("id", "key-form").is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('pdserve.apiKey')") == "s3cret"
        ask(browser, "hi", max_tokens=50)
        assert answer(browser, 1)["text"] == TEXT and len(w.requests()) == 1
        # A key that stops working mid-session: the answer says 401 and the form opens again.
        browser.execute_script("sessionStorage.setItem('pdserve.apiKey', 'revoked')")
        ask(browser, "hi again", max_tokens=50)
        failed = answer(browser, 2)
        assert failed["state"] == "error" and "401 invalid_api_key" in failed["error"]
        assert failed["excluded"] and browser.find_element("id", "key-form").is_displayed()
        assert browser.find_element("id", "prompt").get_property("value") == "hi again"
        assert len(w.requests()) == 1


def test_errors_are_shown_a_refusal_an_error_event_and_an_unreachable_router(browser):
    with RouterHarness() as h:
        h.worker("colo-0", script=toks(TEXT), refuse=1000)  # every dispatch refused
        open_page(browser, h.base_url + "/")
        ask(browser, "too long", max_tokens=100_000)  # beyond the context: the router's 400
        refused = answer(browser, 1)
        assert refused["state"] == "error" and refused["error"].startswith("400 context_length_exceeded: ")
        assert browser.find_element("id", "prompt").get_property("value") == "too long"
        ask(browser, "refused")  # 200, then an error event once the retries are spent
        failed = answer(browser, 2)
        assert failed["state"] == "error" and failed["error"].startswith("the answer failed: worker_error: ")
    # The router is gone now.
    ask(browser, "anyone?")
    gone = answer(browser, 3)
    assert gone["state"] == "error" and gone["error"].startswith("network error: ")
