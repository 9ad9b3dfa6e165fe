"""Pure-PyTorch attention: the CPU path and the oracle every other backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.interface import AttentionBackend, check_shapes, check_window


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """Tokens start .. length-1 of one sequence's paged cache as a dense [length - start, Hkv, D];
    the blocks before `start`'s are not read."""
    block_size = cache.shape[1]
    first = start // block_size
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[first:num_blocks].long())
    skip = first * block_size
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[start - skip : length - skip]


def window_first_block(seq_len: int, window: int, block_size: int) -> int:
    """The first KV block that attention over a sequence of `seq_len` tokens reads (its last query
    at position seq_len-1 sees positions max(0, seq_len-window) ..): 0 when window is 0. Blocks
    before it may be freed once no query before position seq_len-1 is still to come."""
    if window <= 0 or seq_len <= window:
        return 0
    return (seq_len - window) // block_size


class ReferenceBackend(AttentionBackend):
    """Gathers each sequence's blocks and runs dense attention (SDPA per prefill sequence)."""

    name = "reference"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        slots = slot_mapping.long()
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))

    def prefill_attention(
        self, q, key, value, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window: int = 0
    ) -> torch.Tensor:
        check_shapes(q, k_cache, v_cache)
        window = check_window(window)
        cu = cu_seqlens_q.tolist()
        lens = seq_lens.tolist()
        if cu == [0, q.shape[0]] and lens == [q.shape[0]]:
            # One new prompt, no cached prefix: its attention is the step's (no copy into `out`).
            return self.causal_attention(q, key.to(q.dtype), value.to(q.dtype), 0, scale, window)
        out = torch.empty_like(q)
        for b, ctx in enumerate(lens):
            start, end = cu[b], cu[b + 1]
            q_len = end - start
            if q_len == 0:
                continue
            prefix = ctx - q_len
            if prefix == 0:
                k, v = key[start:end], value[start:end]
            else:
                # The prefix from the first key the first row's window holds (0 without a window).
                first = max(0, prefix - window + 1) if window > 0 else 0
                k = gather_kv(k_cache, block_tables[b], ctx, first)
                v = gather_kv(v_cache, block_tables[b], ctx, first)
                prefix -= first
            out[start:end] = self.causal_attention(q[start:end], k.to(q.dtype), v.to(q.dtype), prefix, scale, window)
        return out

    def causal_attention(self, q, k, v, offset: int, scale: float, window: int = 0) -> torch.Tensor:
        """One sequence: q [T, Hq, D] at positions offset .. offset+T-1 over k, v [offset+T, Hkv, D],
        query t seeing keys 0 .. offset+t, only the last `window` of them where window > 0.
        Returns [T, Hq, D]. SDPA, with a mask where offset > 0 or the window leaves keys out."""
        mask = None
        windowed = 0 < window < k.shape[0]  # a window over every key is no window
        if offset > 0 or windowed:
            rows = torch.arange(q.shape[0], device=q.device).unsqueeze(1) + offset
            keys = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
            mask = keys <= rows
            if windowed:
                mask &= keys > rows - window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)

    def decode_attention(self, q, k_cache, v_cache, seq_lens, block_tables, scale, window: int = 0) -> torch.Tensor:
        check_shapes(q, k_cache, v_cache)
        window = check_window(window)
        # The padded gather below costs batch x longest: one long context in a batch of short ones
        # would multiply everyone's work. Sequences of similar length go together instead.
        groups = _length_groups(seq_lens.tolist())
        if len(groups) == 1:
            return self._decode_padded(q, k_cache, v_cache, seq_lens, block_tables, scale, window)
        out = torch.empty_like(q)
        for idx in groups:
            i = torch.tensor(idx, device=q.device)
            out[i] = self._decode_padded(q[i], k_cache, v_cache, seq_lens[i], block_tables[i], scale, window)
        return out

    def _decode_padded(self, q, k_cache, v_cache, seq_lens, block_tables, scale, window) -> torch.Tensor:
        batch, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        group = hq // hkv
        max_len = int(seq_lens.max())
        num_blocks = (max_len + block_size - 1) // block_size
        length = num_blocks * block_size
        # Slot of every (sequence, position) up to the longest sequence. Positions outside a
        # sequence's window (table padding past its end: -1, stale ids; blocks before its
        # window, perhaps freed) read the sequence's own first attended position instead, a
        # value really written (finite, unlike never-written slots); their scores are masked.
        table = block_tables[:, :num_blocks].long().clamp(0, k_cache.shape[0] - 1)
        pos = torch.arange(length, device=q.device)
        slots = (table * block_size).repeat_interleave(block_size, dim=1) + pos % block_size  # [B, L]
        first = (seq_lens.long() - window).clamp(0, length - 1) if window > 0 else torch.zeros_like(seq_lens, dtype=torch.long)
        pad = (pos.unsqueeze(0) >= seq_lens.unsqueeze(1)) | (pos.unsqueeze(0) < first.unsqueeze(1))
        slots = torch.where(pad, slots.gather(1, first.unsqueeze(1)), slots).flatten()
        # One gather per tensor, then [Hkv, B, L, D] so the batch dims collapse for matmul.
        k = k_cache.view(-1, hkv, d).index_select(0, slots).view(batch, length, hkv, d).permute(2, 0, 1, 3).to(q.dtype)
        v = v_cache.view(-1, hkv, d).index_select(0, slots).view(batch, length, hkv, d).permute(2, 0, 1, 3).to(q.dtype)
        qg = q.reshape(batch, hkv, group, d).transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [Hkv, B, G, L]
        scores = scores + torch.zeros(pad.shape, device=q.device).masked_fill_(pad, float("-inf"))[None, :, None, :]
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).transpose(0, 1).reshape(batch, hq, d)


def _length_groups(lens: list[int], slack: float = 2.0) -> list[list[int]]:
    """Indices grouped by length so that no group pads a sequence to more than `slack` x its own
    length (sorted, split wherever the next length exceeds slack x the group's shortest)."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and lens[i] <= slack * max(1, lens[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
