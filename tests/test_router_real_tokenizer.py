"""The router with the real SmolLM2 tokenizer (read without weights) and the engine's detokenizer."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from pdserve.text.loader import load_tokenizer
from tests.fake_worker import RouterHarness

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
