"""The KV cache and the compiled matmuls' packed weights on transparent huge pages
(kernels/huge_pages.py). What that buys is a benchmark's business (bench/cpu_attention_bench.py);
here: the tensors are right, writable, and in mappings advised for huge pages."""

from __future__ import annotations

import gc
import mmap
import sys
import weakref

import pytest
import torch

from pdserve.kernels.huge_pages import (
    HUGE_PAGE,
    copies_on_huge_pages,
    fault_in_background,
    huge_page_share,
    zeros_on_huge_pages,
)
from pdserve.kernels.linear import (
    HUGE_PAGE_SHARE,
    Linear,
    PanelLinear,
    TileLinear,
    use_linear_method,
)


def smaps_field(address: int, field: str) -> list[str] | None:
    """A field of this process's mapping that holds `address` (/proc/self/smaps), if any."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field + ":":
                return line.split()[1:]
    return None


def vm_flags(address: int) -> list[str] | None:
    return smaps_field(address, "VmFlags")


def resident_bytes(address: int) -> int:
    rss = smaps_field(address, "Rss")  # "<n> kB"
    assert rss is not None and rss[1] == "kB"
    return int(rss[0]) * 1024


def thp_policy() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except OSError:
        return None


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")


@linux
def test_zeros_on_huge_pages_is_a_zeroed_writable_tensor_advised_for_huge_pages():
    shape = (3, 2, 1000, 16, 2, 64)
    t = zeros_on_huge_pages(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t[1, 1, 999] = 2.0
    assert t.sum().item() == 2.0 * 16 * 2 * 64
    flags = vm_flags(t.data_ptr())
    assert flags is not None
    # "hg": MADV_HUGEPAGE was taken; kernels without transparent huge pages refuse the advice.
    assert ("hg" in flags) == (thp_policy() is not None)


@linux
def test_a_tensor_smaller_than_a_huge_page_is_plain_zeros():
    t = zeros_on_huge_pages((100, 7), torch.float32)
    assert t.shape == (100, 7) and not t.any()
    assert "hg" not in (vm_flags(t.data_ptr()) or [])


@linux
def test_the_cpu_engines_kv_cache_lives_on_huge_pages_and_outlives_its_mapping_name(tiny):
    from pdserve.config.engine import EngineConfig
    from pdserve.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=4096, dtype="float32"), loaded=tiny)
    kv = engine.runner.kv_cache
    gc.collect()  # the mmap object is referenced only through the tensor's storage
    kv.view(-1)[-1] = 1.0
    assert kv.view(-1)[-1].item() == 1.0
    assert ("hg" in (vm_flags(kv.data_ptr()) or [])) == (thp_policy() is not None)
    engine.runner.kv_fault_in.join(timeout=60)  # faulted in in the background after start-up
    assert resident_bytes(kv.data_ptr()) >= kv.numel() * kv.element_size()
    assert engine.runner.kv_cache_resident and engine.load().kv_resident  # what heartbeats report


@linux
def test_copies_on_huge_pages_equal_their_originals_side_by_side_in_one_mapping():
    originals = [torch.randn(576, 960).to(torch.bfloat16), torch.randn(7, 3), torch.arange(10**6, dtype=torch.int32)]
    copies = copies_on_huge_pages(originals)
    for o, c in zip(originals, copies, strict=True):
        assert c.dtype == o.dtype and c.shape == o.shape and c.is_contiguous() and torch.equal(c, o)
        assert c.data_ptr() % 4096 == 0 and c.data_ptr() != o.data_ptr()
    starts = [c.data_ptr() for c in copies]
    assert starts == sorted(starts) and starts[-1] - starts[0] < 2 * 2**20
    del originals
    gc.collect()
    copies[1].fill_(5.0)  # each copy is its own slice of the mapping
    assert copies[1].sum().item() == 105.0 and copies[2][-1].item() == 10**6 - 1
    assert ("hg" in (vm_flags(starts[0]) or [])) == (thp_policy() is not None)


@linux
def test_huge_page_share_is_the_mappings_huge_pages_over_its_size():
    big = zeros_on_huge_pages((8 * HUGE_PAGE,), torch.uint8).fill_(1)  # touched: its pages are in
    anon, size = smaps_field(big.data_ptr(), "AnonHugePages"), smaps_field(big.data_ptr(), "Size")
    assert anon is not None and size is not None
    assert huge_page_share(big) == pytest.approx(int(anon[0]) / int(size[0]))
    assert huge_page_share(big[HUGE_PAGE:]) == huge_page_share(big)  # any tensor in the mapping
    # A mapping advised against huge pages has none; an empty tensor holds no memory.
    plain = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    plain.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(plain, dtype=torch.uint8)
    t.fill_(1)
    assert huge_page_share(t) == 0.0
    assert huge_page_share(torch.empty(0)) == 0.0
    del t
    plain.close()


@linux
@pytest.mark.parametrize("name, dtype", [("tiles", "bfloat16"), ("panels", "float32")])
def test_packed_weights_of_the_compiled_matmuls_share_one_huge_page_mapping(tiny, ops, name, dtype):
    from pdserve.config.engine import EngineConfig
    from pdserve.engine.engine import Engine

    method = {"tiles": TileLinear, "panels": PanelLinear}[name](ops)
    model = Engine(EngineConfig(model="tiny", num_kv_blocks=16, dtype=dtype), loaded=tiny).runner.model
    weights = {id(m): m.weight.detach().clone() for m in model.modules() if isinstance(m, Linear)}
    use_linear_method(model, method)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert method.streamed == name
    packed = [m.copies[name] for m in linears]  # the copies a decode step streams whole
    span = sum(p.numel() * p.element_size() + 4096 for p in packed)
    first = min(p.data_ptr() for p in packed)
    assert all(0 <= p.data_ptr() - first < span for p in packed)
    assert ("hg" in (vm_flags(first) or [])) == (thp_policy() is not None)
    if name == "tiles":  # the tile kernels are told whether the stream can be left to the hardware
        assert ops.tile_weights_on_huge_pages() == (huge_page_share(packed[0]) >= HUGE_PAGE_SHARE)
    x = {m.weight.shape[1]: torch.randn(3, m.weight.shape[1]).to(m.weight.dtype) for m in linears}
    for m in linears:  # the moved copies still compute each projection
        want = (x[m.weight.shape[1]].float() @ weights[id(m)].float().t())
        torch.testing.assert_close(m(x[m.weight.shape[1]]).float(), want, rtol=2e-2, atol=2e-2)


@linux
def test_fault_in_background_makes_the_cache_resident_and_keeps_what_it_holds():
    shape = (4, 2, 700, 16, 2, 64)  # 8 regions of 700 blocks of 4 KiB: 22 MB
    cache = zeros_on_huge_pages(shape, torch.float32)
    cache[1, 0, 3] = 1.5  # blocks in use before the fault-in starts keep their data
    cache[3, 1, 699] = -2.0
    assert resident_bytes(cache.data_ptr()) < cache.numel() * 4 // 2
    thread = fault_in_background(cache)
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert resident_bytes(cache.data_ptr()) >= cache.numel() * 4
    assert cache[1, 0, 3].eq(1.5).all() and cache[3, 1, 699].eq(-2.0).all()
    assert cache.abs().sum().item() == (1.5 + 2.0) * 16 * 2 * 64


@linux
def test_fault_in_background_lets_a_dropped_cache_go_and_skips_small_ones():
    assert fault_in_background(torch.zeros(100, 7)) is None
    cache = zeros_on_huge_pages((2, 2, 4000, 16, 2, 64), torch.float32)  # 131 MB
    ref = weakref.ref(cache)
    thread = fault_in_background(cache)
    assert thread is not None
    del cache  # the thread holds the cache only while it faults in one chunk
    thread.join(timeout=60)
    assert not thread.is_alive()
    gc.collect()
    assert ref() is None
