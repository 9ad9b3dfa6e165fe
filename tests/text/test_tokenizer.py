"""Tokenizer, chat template and incremental detokenizer, with transformers as the oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pdserve.text.chat_template as chat_template_module
from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.tokenizer import Tokenizer
from tests.helpers.tiny_llama import make_tiny_llama_dir

TEXTS = [
    "Hello, world!",
    "12345",
    "a 12345 b 3.14159 and 1,000,000",
    "  leading and trailing spaces   ",
    "tabs\tand\nnew\r\nlines\n\n\nend",
    "def f(x):\n    return x ** 2  # square\n",
    'for (int i = 0; i < n; ++i) { printf("%d\\n", i); }',
    "emoji 😀👍🏽 and family 👨\u200d👩\u200d👧",
    "漢字とかなカナ、中文句子。",
    "café naïve résumé Ærøskøbing",
    "مرحبا بالعالم हिन्दी",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text <|endoftext|> more",
    "don't they'll I'm we've",
    "https://example.com/path?q=1&r=2",
    "",
]

# SmolLM2's byte-level vocabulary has no token for a few bytes (0xF1, 0xF2 lead bytes of planes 4-11,
# some C0 controls), so text using them cannot round-trip; everything else can.
REPRESENTABLE_CHARS = st.characters(
    codec="utf-8",
    max_codepoint=0x3FFFF,
    exclude_categories=("Cc", "Cs"),
    include_characters="\n\t",
    exclude_characters="\ufffd",
)

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 漢字 😀"},
    ],
    "multi_turn_with_system": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), num_layers=1)


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(
        tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=template
    )


# ----- encode / decode against transformers ------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", ["hi", "<|im_start|>x"])
def test_encode_with_special_tokens_equals_transformers(tok, hf_tok, text):
    assert tok.encode(text, add_special_tokens=True) == hf_tok.encode(text, add_special_tokens=True)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Numerals outside ASCII (e.g. '¼') are left out: SmolLM2's tokenizer.json, llama.cpp's "smollm"
# split and we isolate every Unicode numeral, but transformers' GGUF converter does not.
@given(text=st.text(st.characters(exclude_categories=("Cs",)).filter(lambda c: c.isascii() or not c.isnumeric()),
                    max_size=60))
def test_encode_equals_transformers_on_random_text(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"


def test_special_and_stop_tokens_of_smollm2(tok, hf_tok):
    assert tok.bos_token_id == hf_tok.bos_token_id == 1  # <|im_start|>
    assert tok.eos_token_id == hf_tok.eos_token_id == 2  # <|im_end|>
    assert set(tok.stop_token_ids) == {2, 0}  # <|im_end|>, <|endoftext|>
    assert tok.vocab_size == len(hf_tok) == 49152


def test_digits_are_split_one_by_one(tok):
    assert tok.convert_ids_to_tokens(tok.encode("2024")) == ["2", "0", "2", "4"]


def test_token_to_piece_is_the_tokens_text(tok):
    (space_the,) = tok.encode(" the")
    assert tok.token_to_piece(space_the) == " the"
    assert tok.token_to_piece(tok.eos_token_id) == "<|im_end|>"


def test_saved_tokenizer_json_encodes_the_same(tok, tmp_path):
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    again = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    assert again.eos_token_id == tok.eos_token_id


def _tiny_gguf_metadata(**overrides) -> dict:
    """A byte-level vocabulary: the 256 byte symbols, one merge, two control tokens."""
    from pdserve.text.tokenizer import _BYTE_TO_CHAR

    tokens = ["<s>", "</s>", *_BYTE_TO_CHAR.values(), "hi"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": ["h i"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    return meta | overrides


def test_gguf_add_bos_token_prepends_bos_only_with_special_tokens():
    tok = Tokenizer.from_gguf_metadata(
        _tiny_gguf_metadata(**{"tokenizer.ggml.add_bos_token": True})
    )
    hi = tok.token_to_id("hi")
    assert tok.encode("hi", add_special_tokens=True) == [0, hi]
    assert tok.encode("hi") == [hi]
    assert tok.stop_token_ids == (1,)


def test_unknown_gguf_pre_tokenizer_falls_back_with_a_warning(caplog):
    meta = _tiny_gguf_metadata(**{"tokenizer.ggml.pre": "mystery-v9"})
    with caplog.at_level("WARNING", logger="pdserve.text.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(meta)
    assert "mystery-v9" in caplog.text
    assert tok.decode(tok.encode("hi there")) == "hi there"


def test_non_bpe_gguf_tokenizer_is_a_model_load_error():
    from pdserve.text.model_files import ModelLoadError

    with pytest.raises(ModelLoadError, match="'llama' is not supported"):
        Tokenizer.from_gguf_metadata(_tiny_gguf_metadata(**{"tokenizer.ggml.model": "llama"}))


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [("smollm", ["1", "2", "3", "4", "5"]), ("llama-bpe", ["123", "45"]), ("gpt2", ["12345"])],
)
def test_gguf_pre_tokenizer_splits_digits_as_its_model_expects(pre, pieces):
    from pdserve.text.tokenizer import byte_level_pre_tokenizer

    split = byte_level_pre_tokenizer(pre).pre_tokenize_str("12345")
    assert [piece for piece, _ in split] == pieces


# ----- Hugging Face directory tokenizers --------------------------------------------------------


def test_tiny_dir_tokenizer_matches_the_gguf_one(tok, tiny_dir):
    ours = Tokenizer.from_dir(tiny_dir)
    assert [ours.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    assert ours.chat_template == tok.chat_template
    assert (ours.bos_token_id, ours.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)


def test_tiny_dir_tokenizer_loads_in_transformers(tok, tiny_dir):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tiny_dir)
    assert [theirs.encode(t, add_special_tokens=False) for t in TEXTS] == [
        tok.encode(t) for t in TEXTS
    ]
    messages = CONVERSATIONS["single_user"]
    assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(messages)
    )


def test_generation_config_eos_list_adds_stop_tokens(tmp_path, tiny_dir):
    path = shutil.copytree(tiny_dir, tmp_path / "eos")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert set(Tokenizer.from_dir(path).stop_token_ids) == {0, 2, 7}


# ----- chat template ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tok, hf_tok, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    )


def test_chat_template_sees_special_tokens_and_extra_kwargs(tok):
    t = _with_template(tok, "{{ bos_token }}|{{ eos_token }}|{{ flavour }}|{{ tools is none }}")
    assert t.apply_chat_template([], flavour="mint") == "<|im_start|>|<|im_end|>|mint|True"


def test_chat_template_tojson_does_not_escape_html(tok):
    t = _with_template(tok, "{{ messages[0] | tojson }}")
    rendered = t.apply_chat_template([{"role": "user", "content": "<b>é</b>"}])
    assert json.loads(rendered) == {"role": "user", "content": "<b>é</b>"}
    assert "<b>é</b>" in rendered


def test_chat_template_raise_exception_is_a_value_error(tok):
    t = _with_template(tok, "{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        t.apply_chat_template(CONVERSATIONS["single_user"])


def test_chat_template_that_runs_away_is_stopped(tok, monkeypatch):
    monkeypatch.setattr(chat_template_module, "CHAT_TEMPLATE_TIMEOUT_S", 0.2)
    loops = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="ran longer than"):
        _with_template(tok, loops).apply_chat_template([])


def test_chat_template_that_recurses_forever_is_a_value_error(tok):
    t = _with_template(tok, "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")
    with pytest.raises(ValueError, match="chat template"):
        t.apply_chat_template([])


def test_chat_template_cannot_build_huge_strings(tok):
    with pytest.raises(ValueError, match="repeats a sequence"):
        _with_template(tok, "{{ 'x' * 1000000000 }}").apply_chat_template([])


@pytest.mark.parametrize(
    "template", ["{{ messages.__class__.__mro__ }}", "{% set _ = messages.append(1) %}"]
)
def test_chat_template_sandbox_refuses_internals_and_mutation(tok, template):
    with pytest.raises(ValueError, match="unsafe"):
        _with_template(tok, template).apply_chat_template([])


def test_chat_template_syntax_error_is_a_value_error(tok):
    with pytest.raises(ValueError, match="does not parse"):
        _with_template(tok, "{% for m in messages %}").apply_chat_template([])


def test_missing_chat_template_is_a_value_error(tok):
    t = Tokenizer(tok.backend, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template(CONVERSATIONS["single_user"])


# ----- incremental detokenizer ------------------------------------------------------------------


def _push_in_pieces(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    chunks = [detok.push(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [*chunks, detok.flush()]


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(st.integers(0, 49151), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=40),
    skip_special=st.booleans(),
)
def test_detokenizer_output_equals_decode_for_any_ids_and_split(tok, ids, cuts, skip_special):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special)
    chunks = _push_in_pieces(detok, ids, cuts)
    # An incomplete final character (U+FFFD in the full decode) is dropped by flush.
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip_special).rstrip("\ufffd")
    assert detok.text == "".join(chunks)
    assert not any(chunk.endswith("\ufffd") for chunk in chunks)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(REPRESENTABLE_CHARS, max_size=40) | st.sampled_from(TEXTS),
    cuts=st.lists(st.integers(0, 60), max_size=60),
)
def test_detokenizer_never_emits_a_broken_character_for_valid_text(tok, text, cuts):
    ids = tok.encode(text)
    assume(tok.decode(ids) == text)  # valid UTF-8 the vocabulary can spell
    chunks = _push_in_pieces(IncrementalDetokenizer(tok), ids, cuts)
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert "".join(chunks) == text


def test_detokenizer_holds_a_multibyte_emoji_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "😀"


def test_detokenizer_flush_drops_an_incomplete_final_character(tok):
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the cut really is inside the emoji
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == "ok "
    assert detok.flush() == ""
    assert detok.text == "ok "


def test_detokenizer_work_per_token_stays_bounded(tok):
    class CountingTokenizer:
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            CountingTokenizer.decoded += len(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 40)
    detok = IncrementalDetokenizer(CountingTokenizer())  # type: ignore[arg-type]
    for i in ids:
        detok.push([i])
    assert detok.text == tok.decode(ids)
    assert CountingTokenizer.decoded < 6 * len(ids)  # O(window) per token, not O(output)
