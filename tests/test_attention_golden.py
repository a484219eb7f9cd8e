"""The attention golden's own execution: large goldens run as (batch, kv head) pieces on threads."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("hkv, causal, window, sinks", [(2, "bottom_right", (-1, -1), False), (4, "none", (3, 1), True),
                                                         (1, "top_left", (-1, -1), True)])
def test_attention_by_pieces_on_threads_is_the_whole_call(hkv, causal, window, sinks, monkeypatch):
    """(batch, kv head) pieces on threads give the whole call's arrays bit for bit, empty rows included."""
    from kernel_parity.refimpl import attention as A

    rng = np.random.default_rng(11)
    b, s_q, s_k, h_q, d = 3, 7, 5, 4, 16
    q, k, v = (rng.standard_normal(s) for s in ((b, s_q, h_q, d), (b, s_k, hkv, d), (b, s_k, hkv, d + 8)))
    kw = dict(causal=causal, window=window, softcap=20.0, sinks=rng.standard_normal(h_q) if sinks else None,
              k_lens=np.array([5, 0, 3]))
    monkeypatch.setattr(A, "PIECE_LOGITS", 1 << 40)
    whole = A.attention(q, k, v, **kw)
    monkeypatch.setattr(A, "PIECE_LOGITS", 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    pieces = A.attention(q, k, v, **kw)
    assert all(np.array_equal(x, y) for x, y in zip(whole, pieces))
