"""The KV wire messages, tensor frames and KV payloads: round trips and strict refusals."""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest
import torch

from pdserve.engine.kv_cache import KVPayloadError, gather_blocks, scatter_blocks
from pdserve.kvtransfer.payload import (
    fingerprint_matches,
    fingerprint_mismatch,
    payload_shape_mismatch,
    with_header,
)
from pdserve.kvtransfer.tensors import (
    TensorFrameError,
    as_bytes,
    checksum,
    describe,
    tensor_from_buffer,
    verify,
    verify_reason,
)
from pdserve.protocol import codec, messages
from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.messages import KVAck, KVTransfer, ModelFingerprint, TensorHeader
from pdserve.protocol.sampling import SamplingParams

FP = ModelFingerprint(
    "tiny", "llama", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4
)


def kv_cache(num_blocks: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(
        FP.num_layers, 2, num_blocks, FP.block_size, FP.num_kv_heads, FP.head_dim
    ).to(dtype)


def transfer(payload: torch.Tensor, num_computed_tokens: int = 7, **changes: object) -> KVTransfer:
    meta = KVTransfer(
        request_id="req-1",
        prefill_worker_id="prefill-0",
        prompt_token_ids=tuple(range(num_computed_tokens)),
        output_token_ids=(42,),
        sampling=SamplingParams(temperature=0.0, max_tokens=8),
        num_computed_tokens=num_computed_tokens,
        fingerprint=FP,
        tensor=describe(payload),
        transport="tcp",
        lease_deadline=123.5,
    )
    return with_header(meta, **changes)


# --- messages -----------------------------------------------------------------------------


def test_kv_transfer_round_trips_through_encode_decode():
    meta = transfer(gather_blocks(kv_cache(), [3, 1]), location=b"\x00segment")
    assert codec.decode(codec.encode(meta)) == meta


def test_kv_ack_round_trips_through_encode_decode():
    ack = KVAck(request_id="req-1", ok=False, reason="checksum mismatch")
    assert codec.decode(codec.encode(ack)) == ack


def test_decode_refuses_a_pickle_without_running_it(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Exploit())
    with pytest.raises(ProtocolError):
        codec.decode(payload)
    assert not marker.exists()


def test_decode_refuses_random_bytes():
    with pytest.raises(ProtocolError):
        codec.decode(os.urandom(256))


def test_decode_refuses_a_truncated_message():
    data = codec.encode(transfer(gather_blocks(kv_cache(), [0, 1])))
    with pytest.raises(ProtocolError):
        codec.decode(data[: len(data) // 2])


def test_decode_refuses_another_protocol_version():
    data = codec.encode(KVAck(request_id="r", ok=True, version=messages.PROTOCOL_VERSION + 1))
    with pytest.raises(ProtocolError, match="version"):
        codec.decode(data)


def test_decode_refuses_an_unknown_tag():
    data = msgspec.msgpack.encode(
        {"type": "exec", "version": messages.PROTOCOL_VERSION, "code": "1"}
    )
    with pytest.raises(ProtocolError):
        codec.decode(data)


def test_decode_refuses_an_unknown_field_in_a_tensor_header():
    meta = msgspec.to_builtins(transfer(gather_blocks(kv_cache(), [0, 1])))
    meta["tensor"]["strides"] = [1]
    with pytest.raises(ProtocolError):
        codec.decode(msgspec.msgpack.encode(meta))


# --- tensor frames ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_from_buffer_returns_the_same_values_without_copying(dtype):
    t = torch.randn(3, 5, 7).to(dtype)
    buf = bytearray(as_bytes(t).numpy().tobytes())
    view = tensor_from_buffer(describe(t), buf)
    assert torch.equal(view, t)
    buf[0] ^= 0xFF  # the view reads the buffer itself
    assert not torch.equal(view, t)


def test_tensor_from_buffer_refuses_a_size_that_disagrees_with_the_header():
    t = torch.randn(4, 4)
    with pytest.raises(TensorFrameError, match="bytes"):
        tensor_from_buffer(describe(t), as_bytes(t).numpy().tobytes()[:-4])


def test_tensor_from_buffer_refuses_a_header_whose_nbytes_lies():
    header = TensorHeader(dtype="float32", shape=(4, 4), nbytes=60, checksum="crc32:00000000")
    with pytest.raises(TensorFrameError, match="header says"):
        tensor_from_buffer(header, bytes(60))


@pytest.mark.parametrize("dtype", ["object", "complex64", "str", "float"])
def test_tensor_from_buffer_refuses_a_dtype_outside_the_allow_list(dtype):
    header = TensorHeader(dtype=dtype, shape=(2,), nbytes=8, checksum="crc32:00000000")
    with pytest.raises(TensorFrameError, match="not allowed"):
        tensor_from_buffer(header, bytes(8))


def test_tensor_from_buffer_refuses_a_negative_dimension():
    header = TensorHeader(dtype="float32", shape=(-1, -4), nbytes=16, checksum="crc32:00000000")
    with pytest.raises(TensorFrameError, match="shape"):
        tensor_from_buffer(header, bytes(16))


@pytest.mark.parametrize("algorithm", ["crc32", "wsum64"])
def test_verify_detects_a_single_flipped_byte(algorithm):
    t = torch.randn(2, 3, 1000)
    header = describe(t, algorithm=algorithm)
    assert verify(header, t)
    as_bytes(t)[4321] ^= 1
    assert "checksum mismatch" in verify_reason(header, t)


def test_wsum64_detects_two_swapped_words_that_a_plain_sum_would_miss():
    t = torch.arange(10000, dtype=torch.int32)
    header = describe(t, algorithm="wsum64")
    swapped = t.clone()
    swapped[[17, 9000]] = swapped[[9000, 17]]
    assert not verify(header, swapped)


@pytest.mark.parametrize("numel", [0, 1, 3, 4097, 8192])
def test_wsum64_is_defined_for_every_size(numel):
    t = torch.randint(0, 255, (numel,), dtype=torch.uint8)
    assert checksum(t, "wsum64") == checksum(t.clone(), "wsum64")


def test_verify_refuses_a_tensor_of_another_shape():
    t = torch.randn(4, 4)
    assert "header says" in verify_reason(describe(t), t.view(2, 8))


def test_verify_refuses_an_unknown_checksum_algorithm():
    t = torch.randn(4)
    header = TensorHeader("float32", (4,), 16, "md4:abcd")
    assert "no known algorithm" in verify_reason(header, t)


def test_describe_names_the_dtype_shape_and_size():
    header = describe(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert (header.dtype, header.shape, header.nbytes) == ("bfloat16", (2, 3), 12)
    assert header.checksum.startswith("xxh3:")


# --- KV payloads --------------------------------------------------------------------------


def test_gather_then_scatter_moves_each_block_to_its_new_id():
    src, dst = kv_cache(), torch.zeros_like(kv_cache())
    payload = gather_blocks(src, [5, 2, 7])
    assert payload.is_contiguous() and payload.shape == (2, 2, 3, 4, 2, 4)
    scatter_blocks(dst, [0, 6, 3], payload)
    for i, j in [(5, 0), (2, 6), (7, 3)]:
        assert torch.equal(dst[:, :, j], src[:, :, i])
    assert dst[:, :, [1, 2, 4, 5, 7]].abs().sum() == 0


def test_scatter_refuses_a_payload_with_another_block_count():
    with pytest.raises(KVPayloadError, match="expected"):
        scatter_blocks(kv_cache(), [0, 1], gather_blocks(kv_cache(), [0, 1, 2]))


def test_scatter_refuses_repeated_block_ids():
    with pytest.raises(KVPayloadError, match="repeat"):
        scatter_blocks(kv_cache(), [1, 1], gather_blocks(kv_cache(), [0, 1]))


def test_scatter_refuses_a_payload_of_another_dtype():
    with pytest.raises(KVPayloadError, match="dtype"):
        scatter_blocks(kv_cache(), [0], gather_blocks(kv_cache(dtype=torch.bfloat16), [0]))


def test_gather_refuses_a_block_id_outside_the_cache():
    with pytest.raises(KVPayloadError, match=r"\[0, 8\)"):
        gather_blocks(kv_cache(), [8])


def test_fingerprint_mismatch_names_the_differing_field():
    other = msgspec.structs.replace(FP, head_dim=8)
    assert fingerprint_matches(FP, FP)
    assert not fingerprint_matches(FP, other)
    assert "head_dim" in fingerprint_mismatch(FP, other)


def test_payload_shape_matches_its_fingerprint_and_token_count():
    payload = gather_blocks(kv_cache(), [0, 1])  # 2 blocks of 4 hold 5..8 tokens
    assert payload_shape_mismatch(transfer(payload, num_computed_tokens=7)) is None
    assert "does not match" in payload_shape_mismatch(transfer(payload, num_computed_tokens=9))
    assert "does not match" in payload_shape_mismatch(transfer(payload, num_computed_tokens=4))
