"""Workloads: seeded, the right lengths and arrival shapes, JSONL round trip, exact tokenizer counts."""

import math

import numpy as np
import pytest

from pdserve.bench.workloads import (
    Arrival,
    PromptMaker,
    RequestSpec,
    WorkloadConfig,
    WorkloadKind,
    arrival_offsets,
    build_workload,
    read_jsonl,
    restamp,
    write_jsonl,
)


def test_same_seed_gives_the_same_workload_and_another_seed_does_not():
    cfg = WorkloadConfig(num_requests=20, request_rate=5.0, seed=7)
    assert build_workload(cfg) == build_workload(cfg)
    assert build_workload(cfg) != build_workload(WorkloadConfig(num_requests=20, request_rate=5.0, seed=8))


def test_random_lengths_stay_in_the_requested_range():
    specs = build_workload(WorkloadConfig(num_requests=50, input_len=100, output_len=20, range_ratio=0.5))
    assert all(50 <= s.prompt_tokens <= 150 for s in specs)
    assert all(10 <= s.max_tokens <= 30 for s in specs)
    assert all(len(s.prompt.split()) == s.prompt_tokens for s in specs)  # ~1 token a word without a tokenizer


def test_changing_the_rate_keeps_every_prompt():
    a = build_workload(WorkloadConfig(num_requests=10, request_rate=1.0))
    b = build_workload(WorkloadConfig(num_requests=10, request_rate=50.0))
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert a[-1].arrival_s > b[-1].arrival_s


def test_poisson_arrivals_have_the_requested_mean_rate():
    t = arrival_offsets(4000, 20.0, Arrival.POISSON, 1.0, np.random.default_rng(0))
    assert (len(t) - 1) / t[-1] == pytest.approx(20.0, rel=0.1)


def test_gamma_burstiness_below_one_makes_gaps_more_variable():
    rng = np.random.default_rng(0)
    cv = lambda xs: np.std(np.diff(xs)) / np.mean(np.diff(xs))  # noqa: E731
    assert cv(arrival_offsets(3000, 10.0, Arrival.GAMMA, 0.2, rng)) > 1.5
    assert cv(arrival_offsets(3000, 10.0, Arrival.POISSON, 1.0, rng)) == pytest.approx(1.0, abs=0.15)


def test_constant_arrivals_are_evenly_spaced_and_infinite_rate_sends_all_at_once():
    assert arrival_offsets(4, 2.0, Arrival.CONSTANT, 1.0, np.random.default_rng(0)) == pytest.approx([0, 0.5, 1.0, 1.5])
    assert arrival_offsets(3, math.inf, Arrival.POISSON, 1.0, np.random.default_rng(0)) == [0.0, 0.0, 0.0]


def test_code_workload_is_bursty_and_long_tailed():
    specs = build_workload(WorkloadConfig(kind=WorkloadKind.CODE, num_requests=400, request_rate=10.0,
                                          input_len=200))
    gaps = np.diff([s.arrival_s for s in specs])
    assert np.std(gaps) / np.mean(gaps) > 1.3
    lens = np.array([s.prompt_tokens for s in specs])
    assert lens.max() > 4 * np.median(lens)


def test_shared_prefix_requests_of_a_group_start_with_the_same_text():
    specs = build_workload(WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, num_requests=8, num_prefixes=2,
                                          prefix_len=30, input_len=10))
    groups = {}
    for s in specs:
        groups.setdefault(s.tag, []).append(s.prompt.split()[:30])
    assert set(groups) == {"prefix-0", "prefix-1"}
    for prefixes in groups.values():
        assert all(p == prefixes[0] for p in prefixes)
    assert groups["prefix-0"][0] != groups["prefix-1"][0]
    assert all(30 + 5 <= s.prompt_tokens <= 30 + 15 for s in specs)


def test_interference_mixes_short_chats_with_long_prompts_at_intervals():
    specs = build_workload(WorkloadConfig(kind=WorkloadKind.INTERFERENCE, num_requests=60, request_rate=10.0,
                                          arrival=Arrival.CONSTANT, input_len=16, long_input_len=500,
                                          long_interval_s=2.0))
    longs = [s for s in specs if s.tag == "long"]
    shorts = [s for s in specs if s.tag == "short"]
    assert len(shorts) == 60
    assert [s.arrival_s for s in longs] == pytest.approx([2.0, 4.0])  # shorts span 5.9 s
    assert all(s.prompt_tokens == 500 for s in longs)
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)


def test_workload_round_trips_through_jsonl(tmp_path):
    specs = build_workload(WorkloadConfig(num_requests=5, request_rate=3.0))
    write_jsonl(tmp_path / "w.jsonl", specs)
    assert read_jsonl(tmp_path / "w.jsonl") == specs


def test_malformed_workload_line_is_reported_with_its_line_number(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"request_id": "a", "prompt": "x", "prompt_tokens": 1, "max_tokens": 2}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"w.jsonl:2"):
        read_jsonl(path)


def test_restamp_redraws_times_and_keeps_requests():
    specs = [RequestSpec(request_id=str(i), prompt="a b", prompt_tokens=2, max_tokens=4) for i in range(4)]
    out = restamp(specs, 2.0, Arrival.CONSTANT, 1.0, seed=0)
    assert [s.arrival_s for s in out] == pytest.approx([0.0, 0.5, 1.0, 1.5])
    assert [s.prompt for s in out] == [s.prompt for s in specs]


def test_tokenizer_makes_prompt_token_counts_exact(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pdserve.bench.workloads import _WORDS

    # A tiny BPE whose vocabulary splits most words into several tokens: counting words is wrong.
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([" ".join(_WORDS)] * 3, trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    maker = PromptMaker(str(path))
    rng = np.random.default_rng(0)
    for n in (1, 17, 64, 200):
        text, count = maker.make(n, rng)
        assert count == n
        assert len(tok.encode(text, add_special_tokens=False).ids) == n
