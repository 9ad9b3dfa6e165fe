"""Sampling parameters: each one's effect, seeds independent of the batch, errors naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.protocol.sampling import SamplingParams, SamplingParamsError


def req(params: SamplingParams, prompt=(1, 2, 3), output=(), eos=(0,)) -> Request:
    r = Request("r", list(prompt), params, eos)
    r.token_ids.extend(output)
    return r


LOGITS = torch.tensor([[0.1, 3.0, 2.5, 2.0, -1.0, 0.5]])


def test_greedy_takes_the_argmax():
    assert Sampler()(LOGITS.clone(), [req(SamplingParams(temperature=0))]).token_ids == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_through_the_compiled_argmax_match_torchs(ops, dtype):
    """The compiled argmax takes plain greedy batches straight off the model's logits (no float32
    copy) and the greedy rows of mixed ones; both give torch's tokens."""
    logits = (torch.randn(8, 1000) * 3).to(dtype)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first
    want = logits.float().max(dim=-1).indices.tolist()
    plain = [req(SamplingParams(temperature=0)) for _ in range(8)]
    assert Sampler(ops=ops)(logits.clone(), plain).token_ids == want
    mixed = [req(SamplingParams(temperature=0, logprobs=2 if i == 0 else None)) for i in range(8)]
    mixed[5] = req(SamplingParams(temperature=1.0, top_k=1))
    got = Sampler(ops=ops)(logits.clone(), mixed)
    assert got.token_ids == want and got.logprobs is not None
    assert [Sampler()(logits.clone(), plain).token_ids] == [want]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_rows_on_the_gpu_take_the_argmax_there(dtype, monkeypatch):
    """Only the token ids cross to the host (no [B, V] copy), and they are the CPU's tokens, ties
    to the first; a row that edits its logits still gets the float32 host copy."""
    logits = (torch.randn(8, 1000) * 3).to(dtype)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1
    want = logits.float().max(dim=-1).indices.tolist()
    plain = [req(SamplingParams(temperature=0)) for _ in range(8)]
    copies = []
    original = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies.append(tuple(t.shape)) or original(t, *a, **k))
    assert Sampler()(logits.cuda(), plain).token_ids == want
    assert copies == []
    with_lp = [req(SamplingParams(temperature=0, logprobs=1))] + plain[1:]
    got = Sampler()(logits.cuda(), with_lp)
    assert got.token_ids == want and copies == [(8, 1000)]


@pytest.mark.parametrize("params,token", [
    (SamplingParams(temperature=0, repetition_penalty=4.0), 2),
    (SamplingParams(temperature=0, presence_penalty=2.0), 2),
    (SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1]), 2),
    (SamplingParams(temperature=0, logprobs=1), 1),
])
def test_rows_that_edit_their_logits_leave_the_plain_argmax_path(ops, params, token):
    """A penalty or a min_tokens mask still moves the greedy token with the compiled argmax, as
    without it (token 1 is the argmax of LOGITS and the one already output)."""
    r = req(params, prompt=(4,), output=(1,))
    got = Sampler(ops=ops)(LOGITS.clone(), [r])
    assert got.token_ids == Sampler()(LOGITS.clone(), [r]).token_ids == [token]
    assert (got.logprobs is not None) == (params.logprobs is not None)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=0.01),
    SamplingParams(temperature=1.0, min_p=1.0),
])
def test_truncation_to_one_token_is_greedy(params):
    s = Sampler(seed=3)
    assert {s(LOGITS.clone(), [req(params)]).token_ids[0] for _ in range(20)} == {1}


def test_top_k_draws_only_from_the_k_best():
    s = Sampler(seed=1)
    drawn = {s(LOGITS.clone(), [req(SamplingParams(temperature=2.0, top_k=3))]).token_ids[0] for _ in range(200)}
    assert drawn == {1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS[0], 0)
    s = Sampler(seed=2)
    p = float(probs[1] + probs[2]) - 1e-4  # tokens 1 and 2 reach it; 3 is not needed
    drawn = {s(LOGITS.clone(), [req(SamplingParams(temperature=1.0, top_p=p))]).token_ids[0] for _ in range(200)}
    assert drawn == {1, 2}


def test_same_seed_same_draws_and_other_seeds_differ():
    def draws(seed):
        r = req(SamplingParams(temperature=1.5, seed=seed))
        s = Sampler(seed=99)
        out = []
        for _ in range(30):  # each draw is for the next output position
            out.append(s(LOGITS.clone(), [r]).token_ids[0])
            r.append_token(out[-1])
        return out

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_a_seeded_draw_depends_only_on_the_seed_and_the_position():
    """What lets another worker continue a seeded request exactly (the prefill/decode hand-off)."""
    def draw_at(position, history):
        r = req(SamplingParams(temperature=1.5, seed=5))
        for t in history[:position]:
            r.append_token(t)
        return Sampler(seed=123)(LOGITS.clone(), [r]).token_ids[0]

    assert draw_at(3, [0, 0, 0]) == draw_at(3, [5, 4, 3])  # the tokens before do not matter
    assert len({draw_at(k, [1] * 40) for k in range(40)}) > 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 1.0]])
    Sampler._apply_penalties(logits, [req(SamplingParams(repetition_penalty=2.0), prompt=(0, 1))])
    assert logits.tolist() == [[1.0, -2.0, 1.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    r = req(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=(3, 3), output=(1, 1, 2))
    Sampler._apply_penalties(logits, [r])
    assert logits.tolist() == [[0.0, -1.25, -0.75, 0.0]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    early = req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,)), output=(1,), eos=(0,))
    assert Sampler()(logits.clone(), [early]).token_ids == [1]
    late = req(SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(2,)), output=(1,), eos=(0,))
    assert Sampler()(logits.clone(), [late]).token_ids == [0]


def test_logprobs_are_log_softmax_and_top_n_sorted():
    r = req(SamplingParams(temperature=0, logprobs=3))
    out = Sampler()(LOGITS.clone(), [r])
    ref = torch.log_softmax(LOGITS[0], 0)
    assert math.isclose(out.logprobs[0], float(ref[1]), abs_tol=1e-6)
    ids = [t for t, _ in out.top_logprobs[0]]
    assert ids == [1, 2, 3]


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("frequency_penalty", 3.0), ("presence_penalty", -3.0), ("max_tokens", 0),
    ("min_tokens", 99), ("seed", -1), ("logprobs", 21),
])
def test_invalid_parameter_raises_naming_it(field, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value}).validate()
    assert err.value.param == field


def test_stop_token_outside_vocabulary_is_refused():
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(10**9,)).validate(vocab_size=100)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(dtype="float32", loaded=tiny, block_size=4)


def test_seeded_request_is_the_same_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    alone = llm.generate("a seeded request", seeded, use_tqdm=False)[0].token_ids
    batch = llm.generate(["noise one", "a seeded request", "noise two two"], [other, seeded, other], use_tqdm=False)
    assert batch[1].token_ids == alone


def test_engine_stops_on_stop_token_and_respects_min_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate("stop here", greedy, use_tqdm=False)[0]
    assert len(first.token_ids) == 6 and first.finish_reason == "length"
    t0 = first.token_ids[0]
    stopped = llm.generate("stop here", SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(t0,)), use_tqdm=False)[0]
    assert stopped.token_ids == [t0] and stopped.finish_reason == "stop"
    held = llm.generate("stop here", SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3,
                                                    stop_token_ids=(t0,)), use_tqdm=False)[0]
    assert len(held.token_ids) >= 3 and t0 not in held.token_ids[:3]
