"""Per-request output processing: stop strings over any token split, event ordering, usage."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.protocol.messages import TokenEvent
from pdserve.router.registry import Route
from pdserve.router.requests import Choice, StopMatcher
from tests.helpers.fake_worker import FakeDetokenizer, FakeTokenizer, toks

alphabet = st.sampled_from("abcAB ")


def run_matcher(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    m, out = StopMatcher(stops), []
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


@given(
    st.lists(st.text(alphabet, max_size=4), max_size=12),
    st.lists(st.text(alphabet, min_size=1, max_size=3), max_size=3),
)
def test_stop_matcher_cuts_at_first_stop_whatever_the_split(pieces, stops):
    full = "".join(pieces)
    hits = [i for i in (full.find(s) for s in stops) if i >= 0]
    text, hit = run_matcher(pieces, stops)
    assert hit == bool(hits)
    assert text == (full[: min(hits)] if hits else full)


def test_stop_matcher_never_emits_a_stop_prefix_before_it_is_decided():
    m = StopMatcher(["END"])
    assert m.push("abcE") == ("abc", False)
    assert m.push("N") == ("", False)
    assert m.push("x") == ("ENx", False)


def choice(stops=()) -> Choice:
    return Choice(0, "r-0", Route("colocated", "w"), FakeDetokenizer(FakeTokenizer()), stops)


def ev(tokens, position, finish=None, **kw) -> TokenEvent:
    return TokenEvent(
        request_id="r-0", token_ids=tuple(tokens), position=position, finish_reason=finish, **kw
    )


def test_events_are_reordered_by_position():
    c = choice()
    h, lo, wor = toks("Hel") + toks("lo") + toks(" wor")
    assert c.in_order(ev([lo, wor], 1, "length")) == []  # decode's tokens overtook the first token
    ready = c.in_order(ev([h], 0))
    text = "".join(c.apply(e, False).text for e in ready)
    assert text == "Hello wor" and c.finish_reason == "length" and c.completion_tokens == 3


def test_repeated_tokens_are_dropped():
    c = choice()
    a, b = toks("ab")
    assert len(c.in_order(ev([a], 0))) == 1
    (again,) = c.in_order(ev([a, b], 0))
    assert again.token_ids == (b,) and again.position == 1


def test_stop_string_finishes_choice_and_counts_tokens_up_to_the_match():
    c = choice(["lo w"])
    delta = c.apply(ev(toks("Hello world"), 0), False)
    assert (delta.text, delta.finish_reason, c.completion_tokens) == ("Hel", "stop", 3)


def test_final_flush_releases_held_text_when_no_stop_matches():
    c = choice(["dx"])
    delta = c.apply(
        ev(toks("Hello world"), 0, "stop", num_prompt_tokens=7, num_cached_tokens=3), False
    )
    assert delta.text == "Hello world" and delta.finish_reason == "stop"
    assert (c.num_prompt_tokens, c.num_cached_tokens) == (7, 3)
