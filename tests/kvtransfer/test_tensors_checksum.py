"""Payload checksums: xxh3 by default on the CPU, every flipped byte or moved block caught, and
headers naming the older algorithms still verified."""

from __future__ import annotations

import pytest
import torch
import xxhash

from pdserve.kvtransfer.tensors import (
    CHECKSUM_ALGORITHMS,
    as_bytes,
    checksum,
    default_algorithm,
    describe,
    verify,
    verify_reason,
)

SIZES = [1, 17, 1025, 1 << 20]  # bytes: one, odd, just past a stripe, a MiB


def payload(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    g = torch.Generator().manual_seed(nbytes)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def flipped(t: torch.Tensor, at: int) -> torch.Tensor:
    out = t.clone()
    as_bytes(out)[at] ^= 0x01
    return out


def test_xxh3_is_the_cpu_default_and_is_xxh3_64_of_the_raw_bytes():
    t = payload(4096, torch.bfloat16)
    assert default_algorithm(t) == "xxh3" and "xxh3" in CHECKSUM_ALGORITHMS
    expected = xxhash.xxh3_64_hexdigest(bytes(as_bytes(t).numpy()))
    assert describe(t).checksum == checksum(t) == f"xxh3:{expected}"
    assert len(expected) == 16


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_fails_xxh3_verification(nbytes, where):
    t = payload(nbytes)
    header = describe(t, algorithm="xxh3")
    at = {"first": 0, "middle": nbytes // 2, "last": nbytes - 1}[where]
    assert verify(header, t)
    assert "checksum mismatch" in verify_reason(header, flipped(t, at))


def test_a_block_sent_in_the_wrong_place_fails_xxh3_verification():
    blocks = payload(8 << 10, torch.float32).view(4, 512)
    header = describe(blocks)
    swapped = blocks[[1, 0, 2, 3]].contiguous()  # the same bytes, two blocks exchanged
    assert not verify(header, swapped)
    assert not verify(header, torch.cat([blocks[:3], blocks[:1]]))  # a reused block


@pytest.mark.parametrize("algorithm", ["crc32", "wsum64"])
def test_a_header_naming_an_older_algorithm_still_verifies(algorithm):
    t = payload(1025 * 4, torch.float32)
    header = describe(t, algorithm=algorithm)
    assert header.checksum.startswith(f"{algorithm}:")
    assert verify_reason(header, t) is None
    assert "checksum mismatch" in verify_reason(header, flipped(t, 7))


def test_an_empty_tensor_has_a_checksum_that_verifies():
    t = torch.empty(0, 4)
    assert verify(describe(t), t)
