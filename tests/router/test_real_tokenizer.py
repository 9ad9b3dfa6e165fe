"""The router with the real SmolLM2 tokenizer (read without weights) and the engine's detokenizer."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from pdserve.text.loader import load_tokenizer
from tests.helpers.fake_worker import RouterHarness

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

REPLY = "Bonjour ! Ça va ? 🙂 Paris est la capitale."


@pytest.fixture(scope="module")
def router():
    source = load_tokenizer("default")
    with RouterHarness(tokenizer=source.tokenizer, served_model_name=source.name) as h:
        tok = source.tokenizer
        h.worker("colo-0", script=tok.encode(REPLY) + [tok.eos_token_id])
        yield h


def test_tokenizer_loads_without_torch():
    code = "import sys; from pdserve.text.loader import load_tokenizer; load_tokenizer('default'); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True
    )
    assert out.stdout.strip() == "False"


def test_chat_through_real_template_and_detokenizer(router):
    c = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Salut"}]
    )
    assert r.choices[0].message.content == REPLY and r.choices[0].finish_reason == "stop"
    prompt = router.workers[0].requests()[-1].token_ids
    text = router.tokenizer.decode(prompt, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nSalut<|im_end|>\n<|im_start|>assistant\n")
    assert router.tokenizer.eos_token_id in router.workers[0].requests()[-1].sampling.stop_token_ids


def test_streamed_emoji_arrives_whole_and_stop_string_is_cut(router):
    c = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        c.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            stream=True,
            stop=" est",
            messages=[{"role": "user", "content": "Salut"}],
        )
    )
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(pieces) == REPLY[: REPLY.index(" est")]
    assert all("\ufffd" not in p for p in pieces)


def _cut_inside_a_character(tok, text: str) -> tuple[list[int], int]:
    ids = tok.encode(text)
    k = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    return ids, k


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_inside_a_multibyte_character_ends_without_a_broken_one(stream):
    source = load_tokenizer("default")
    tok = source.tokenizer
    ids, k = _cut_inside_a_character(tok, "Bonjour 🙂🙂 fin")
    with RouterHarness(tokenizer=tok, served_model_name="m") as h:
        h.worker("colo-0", script=ids)
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0)
        args = {"model": "m", "messages": [{"role": "user", "content": "Salut"}], "max_tokens": k}
        if stream:
            chunks = list(c.chat.completions.create(stream=True, **args))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        else:
            r = c.chat.completions.create(**args)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            comp = c.completions.create(model="m", prompt="Salut", max_tokens=k)
            assert comp.choices[0].text == text
    assert finish == "length"
    assert "\ufffd" not in text
    assert text == tok.decode(ids[:k]).rstrip("\ufffd") and text.startswith("Bonjour")
