"""FlashMLA's split scheduler (`get_mla_metadata`) in eager torch: prefix sums and a search per SM part.

    num_sm_parts P = sms // h_kv // ceil(s_q h_q / h_kv / 64)
    cost_i  = ceil(L_i / 64) + 5;  payload = ceil(sum cost / P) + 5, >= 10 when `floor`
    part p: finish the current request if its rest + 5 fits the part's remaining payload, then every
    whole request that fits (one searchsorted over the costs' prefix sums), then, if more than 5 is
    left, that many blocks minus 5 of the next request (a split); the part is then full.

Returns (meta (P, 8) int32, num_splits (b + 1,) int32) on seqlens' device; rows
[begin_idx, begin_seqlen, end_idx, end_seqlen, begin_n_split_idx, 0, 0, 0]. The loop over parts runs on
the host (P values read back per part): a baseline, not a fast path. Conventions: refimpl/mla_schedule.py.
"""

from __future__ import annotations

import torch

__all__ = ["get_mla_metadata", "num_sm_parts"]

BLOCK, FIXED_OVERHEAD = 64, 5


def num_sm_parts(sms: int, s_q: int, h_q: int, h_kv: int = 1) -> int:
    return sms // h_kv // -(-(s_q * h_q // h_kv) // 64)


def get_mla_metadata(seqlens: torch.Tensor, s_q: int, h_q: int, h_kv: int, sms: int, floor: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    if seqlens.ndim != 1 or seqlens.numel() < 1 or h_q % h_kv:
        raise ValueError(f"need seqlens (b >= 1,) and h_q % h_kv == 0, got {tuple(seqlens.shape)}, {h_q}, {h_kv}")
    parts = num_sm_parts(sms, s_q, h_q, h_kv)
    if parts < 1:
        raise ValueError(f"num_sm_parts = {parts} for sms={sms}, s_q={s_q}, h_q={h_q}, h_kv={h_kv}")
    f, dev = FIXED_OVERHEAD, seqlens.device
    L = seqlens.to(torch.int64)
    blocks = torch.div(L + BLOCK - 1, BLOCK, rounding_mode="floor")
    G = torch.cat([L.new_zeros(1), torch.cumsum(blocks + f, 0)])  # G[i]: the cost of requests 0..i-1
    total = int(G[-1])
    payload = -(-total // parts) + f
    if floor:
        payload = max(payload, 2 * f)
    b = L.numel()
    nb = blocks.tolist()
    rows = torch.zeros((parts, 8), dtype=torch.int64)
    splits = torch.ones(b, dtype=torch.int64)  # a request finished by the part that started it: 1 split
    r, k, ns = 0, 0, 0  # the first unfinished request, its first unassigned block, its splits so far
    for p in range(parts):
        rows[p, 0], rows[p, 1], rows[p, 4] = r, k * BLOCK, ns
        remain = payload
        if r < b:
            rest = nb[r] - k + f
            if remain >= rest:
                splits[r] = ns + 1
                remain -= rest
                r, k, ns = r + 1, 0, 0
                e = int(torch.searchsorted(G, G[r] + remain, right=True)) - 1  # whole requests r..e-1 fit
                e = min(e, b)
                remain -= int(G[e] - G[r])
                r = e
                if r < b and remain > f:
                    k, ns = remain - f, 1
            elif remain > f:
                k, ns = k + remain - f, ns + 1
        rows[p, 2] = r if k > 0 else r - 1
        rows[p, 3] = k * BLOCK if k > 0 else int(L[r - 1])
    if (r, k, ns) != (b, 0, 0):
        raise RuntimeError(f"get_mla_metadata: request {r} block {k} left unassigned")
    num_splits = torch.cat([splits.new_zeros(1), torch.cumsum(splits, 0)])
    return rows.to(torch.int32).to(dev), num_splits.to(torch.int32).to(dev)
