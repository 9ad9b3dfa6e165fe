"""The service end to end: real router, prefill and decode processes on loopback, the official
`openai` client, against the offline engine as the oracle. Uses the tiny random Llama (fast)."""

from __future__ import annotations

import asyncio
import pickle
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import torch
import zmq

from pdserve.engine.kv_cache import gather_blocks
from pdserve.engine.llm import LLM
from pdserve.kvtransfer.tensors import describe
from pdserve.kvtransfer.transport.handshake import secure_client
from pdserve.protocol.auth import KV_TO_DECODE, FrameAuth
from pdserve.protocol.codec import decode, encode
from pdserve.protocol.messages import KVAck, KVTransfer, ModelFingerprint
from pdserve.protocol.sampling import SamplingParams
from tests.helpers.service_harness import Cluster

pytestmark = pytest.mark.timeout(300)

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The history of the printing press begins"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def oracle(tiny):
    """What the offline engine answers, greedy, for CHAT and PROMPT (text and token count)."""
    llm = LLM(dtype="float32", loaded=tiny)
    eos = tuple(tiny.tokenizer.stop_token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=eos)
    chat = llm.chat(CHAT, params, use_tqdm=False)[0]
    raw = llm.generate(PROMPT, params, use_tqdm=False)[0]
    return {"chat": (chat.text, len(chat.token_ids)), "completion": (raw.text, len(raw.token_ids))}


@pytest.fixture(scope="module")
def disagg(tiny_dir, tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("disagg"), str(tiny_dir), transport="tcp").start()
    yield cluster
    cluster.stop()


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def model_name(cluster: Cluster) -> str:
    return httpx.get(cluster.base_url + "/v1/models").json()["data"][0]["id"]


def ask_everything(cluster: Cluster) -> dict[str, tuple[str, int]]:
    """Chat and completions, streaming and not, greedy, through the official client."""
    c, model = client(cluster), model_name(cluster)
    out = {}
    r = c.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    out["chat"] = (r.choices[0].message.content, r.usage.completion_tokens)
    chunks = c.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, usage = "", None
    for ch in chunks:
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
        usage = ch.usage or usage
    out["chat-stream"] = (text, usage.completion_tokens)
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    out["completion"] = (r.choices[0].text, r.usage.completion_tokens)
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True) if ch.choices)
    out["completion-stream"] = (text, out["completion"][1])
    return out


def assert_matches_oracle(answers, oracle) -> None:
    for kind, (text, n) in answers.items():
        expected_text, expected_n = oracle[kind.removesuffix("-stream")]
        assert text == expected_text, kind
        assert n == expected_n, kind


def test_disaggregated_tcp_answers_equal_offline_engine(disagg, oracle):
    assert_matches_oracle(ask_everything(disagg), oracle)


def test_disaggregated_shm_answers_equal_offline_engine(tiny_dir, tmp_path_factory, oracle):
    cluster = Cluster(tmp_path_factory.mktemp("shm"), str(tiny_dir), transport="shm").start()
    try:
        assert_matches_oracle(ask_everything(cluster), oracle)
        sent = cluster.info("prefill-0")["handoffs"]
        assert sent and all(h["ok"] for h in sent)
    finally:
        cluster.stop()


@pytest.mark.parametrize("policy", ["static", "prefill-first", "mixed", "chunked"])
def test_colocated_policy_answers_equal_offline_engine(policy, tiny_dir, tmp_path_factory, oracle):
    cluster = Cluster(tmp_path_factory.mktemp(policy), str(tiny_dir), mode="colocated", policy=policy).start()
    try:
        assert_matches_oracle(ask_everything(cluster), oracle)
    finally:
        cluster.stop()


def concurrent_chats(cluster: Cluster, n: int) -> list[str]:
    """CHAT streamed by `n` clients at once, greedy: each one's text."""
    async def one(ac: openai.AsyncOpenAI, model: str) -> str:
        stream = await ac.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def main() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(ac, model_name(cluster)) for _ in range(n)))

    return asyncio.run(main())


def test_32_concurrent_streaming_clients_all_complete(disagg, oracle):
    assert concurrent_chats(disagg, 32) == [oracle["chat"][0]] * 32


def test_first_token_reaches_router_before_kv_transfer_completes(disagg):
    c = client(disagg)
    start = time.time()
    stream = c.completions.create(model=model_name(disagg), prompt="word " * 300, max_tokens=4, temperature=0,
                                  stream=True)
    first_token_at = None
    for ch in stream:
        if ch.choices and ch.choices[0].text and first_token_at is None:
            first_token_at = time.time()
    handoff = [h for h in disagg.info("prefill-0")["handoffs"] if h["kv_sent_at"] >= start][-1]
    assert handoff["first_token_at"] <= handoff["kv_sent_at"] <= handoff["kv_acked_at"]
    assert first_token_at is not None


def test_decode_worker_never_runs_a_prefill_token(disagg):
    ask_everything(disagg)
    info = disagg.info("decode-0")
    assert info["decode_tokens"] > 0
    assert info["prefill_tokens"] == 0 and info["steps_with_prefill"] == 0


def test_hostile_frames_on_every_zmq_port_are_refused_and_service_continues(disagg, tmp_path, oracle):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payloads = [pickle.dumps(Evil()), b"\x00\xffrandom garbage\x13\x37" * 10, encode(KVAck(request_id="x", ok=True))[:5],
                encode(KVAck(request_id="x", ok=True)).replace(b"\xa7version\x01", b"\xa7version\x09")]
    ctx = zmq.Context.instance()
    ports = [disagg.control.rsplit(":", 1)[1], str(disagg.proc("decode-0").kv_port)]
    for port in ports:
        for data in payloads:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 2000)  # deliver before the socket goes
            # Past the connection handshake, so that each frame meets the MAC check (a peer without
            # the secret never gets this far: tests/service/test_unauthenticated_memory.py).
            secure_client(s, FrameAuth.from_secret(disagg.secret.encode()))
            s.connect(f"tcp://127.0.0.1:{port}")
            s.send(data)
            s.send_multipart([data, b"extra frame"])
            s.close()
    deadline = time.time() + 10
    while time.time() < deadline:  # without the deployment's MAC, none of them is even decoded
        dropped = disagg.info("decode-0")["receiver"].get("auth_rejected", 0)
        metrics = httpx.get(disagg.base_url + "/metrics").text
        bad = sum(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("pdserve_control_rejected_total"))
        if dropped >= 2 * len(payloads) and bad >= 2 * len(payloads):
            break
        time.sleep(0.1)
    assert dropped >= 2 * len(payloads) and bad >= 2 * len(payloads), (dropped, bad)
    assert not marker.exists()
    assert all(p.popen.poll() is None for p in disagg.procs)
    assert ask_everything(disagg)["chat"] == oracle["chat"]


def test_flipped_byte_in_kv_payload_is_detected_and_never_decoded(disagg, tiny):
    m = tiny.config
    decode_info = disagg.info("decode-0")
    fp = ModelFingerprint(model=tiny.name, architecture=m.architecture, num_layers=m.num_layers,
                          num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype="float32", block_size=16)
    cache = torch.randn(m.num_layers, 2, 4, 16, m.num_kv_heads, m.head_dim)
    payload = gather_blocks(cache, [0, 1])
    meta = KVTransfer(request_id="corrupt-1", prefill_worker_id="test", prompt_token_ids=tuple(range(1, 21)),
                      output_token_ids=(5,), sampling=SamplingParams(temperature=0.0, max_tokens=4),
                      num_computed_tokens=20, fingerprint=fp, tensor=describe(payload), transport="tcp")
    raw = bytearray(payload.numpy().tobytes())
    raw[1234] ^= 0x01
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    secure_client(s, FrameAuth.from_secret(disagg.secret.encode()))  # a holder of the secret
    s.connect(f"tcp://127.0.0.1:{disagg.proc('decode-0').kv_port}")
    # Signed with the deployment's secret (the MAC covers the header, which carries the payload's
    # checksum): the checksum is what catches it here.
    s.send_multipart([*FrameAuth.from_secret(disagg.secret.encode()).seal(KV_TO_DECODE, [encode(meta)]), bytes(raw)])
    assert s.poll(5000), "no answer from the decode worker"
    ack = decode(s.recv_multipart()[-1])
    s.close()
    assert isinstance(ack, KVAck) and not ack.ok and "checksum" in ack.reason
    info = disagg.info("decode-0")
    assert info["kv_refused"] == decode_info["kv_refused"] + 1
    assert info["decode_tokens"] == decode_info["decode_tokens"]  # nothing decoded from it


def test_disconnect_mid_stream_frees_every_block_within_2s(disagg):
    with httpx.Client(base_url=disagg.base_url, timeout=30) as h, h.stream(
        "POST", "/v1/completions",
        json={"model": model_name(disagg), "prompt": "count " * 100, "max_tokens": 400, "stream": True,
              "ignore_eos": True},
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    infos = disagg.wait_idle(timeout=2.0)
    assert all(i["used_blocks"] == 0 for i in infos.values()), infos


def test_disconnect_while_prefill_is_queued_frees_every_block_within_2s(disagg):
    async def main() -> None:
        async with httpx.AsyncClient(base_url=disagg.base_url, timeout=30) as h:
            body = {"model": model_name(disagg), "prompt": "long " * 1500, "max_tokens": 50, "ignore_eos": True}
            tasks = [asyncio.create_task(h.post("/v1/completions", json=body)) for _ in range(3)]
            await asyncio.sleep(0.3)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    infos = disagg.wait_idle(timeout=2.0)
    assert all(i["used_blocks"] == 0 and i["waiting"] == 0 and i["running"] == 0 for i in infos.values()), infos


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}]}), 400),
        (msgspec.json.encode({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}), 404),
        (msgspec.json.encode({"model": "M", "messages": []}), 400),
        (msgspec.json.encode({"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}), 400),
        (msgspec.json.encode({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}), 400),
    ],
)
def test_malformed_requests_get_4xx_envelopes_and_service_continues(disagg, body, status, oracle):
    body = body.replace(b'"M"', msgspec.json.encode(model_name(disagg)))
    r = httpx.post(disagg.base_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert ask_everything(disagg)["chat"] == oracle["chat"]


def test_benchmark_extras_force_exact_output_length(disagg):
    r = httpx.post(disagg.base_url + "/v1/completions", timeout=60, json={
        "model": model_name(disagg), "prompt": PROMPT, "max_tokens": 20, "min_tokens": 20, "ignore_eos": True,
        "temperature": 0.7, "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 20
