"""Issue 32, TensorRT-LLM S13 / S14 together: rope.kv_update's rotated q (update_kv_cache_rope_fusion's
q_rope) in the ragged layout. q and q_rope are TensorRT-LLM's flattened [B*S, N, D] buffers, here
(b * snew, hq, d): a shape of the params although seq_len is drawn (each seq_len <= snew); sequence b's
tokens are rows seq_start[b] + t, rotated at pos[b] + t; the rows past them are never written (the
golden's NaN: any value).

The golden is checked against its fixed layout one sequence at a time; the C kernel bit for bit the
same way, the rows it does not own left as they were; the eager torch and Triton (interpreter) kernels
against the golden; the inputs of the ragged cases without q are those they always had.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_parity.conformance import ops
from kernel_parity.refimpl import rope as ref

P = dict(b=4, snew=6, hkv=2, d=16, smax=40, layout="paged16", rows=6, tokens="ragged")


def _inputs(hq: int, dtype: str = "fp32", **kw):
    spec = ops.get("rope.kv_update")
    p = spec.params.validate(spec.name, {**P, "hq": hq, **kw})
    return p, spec.make_inputs(p, dtype, "normal", np.random.default_rng(4))


def _golden(x):
    return ref.kv_update(x["k_cache"], x["v_cache"], x["k_new"], x["v_new"], x["pos"], x["table"][..., 0],
                         x["table"][..., 1], block_table=x.get("block_table"), cache_loc=x.get("cache_loc"),
                         q=x.get("q"), seq_len=x["seq_len"], seq_start=x["seq_start"])


def _owned(x) -> np.ndarray:
    own = np.zeros(x["q"].shape[0], dtype=bool)
    for first, n in zip(x["seq_start"], x["seq_len"]):
        own[first:first + n] = True
    return own


def test_q_is_drawn_last_and_shaped_by_the_params():
    p, x = _inputs(4)
    _, plain = _inputs(0)
    assert x["q"].shape == (24, 4, 16) == ops.get("rope.kv_update").output_shapes(p)["q_rope"]
    assert all(np.array_equal(x[k], plain[k]) for k in plain)  # the case without q: the draws of before
    assert 0 < _owned(x).sum() < 24  # padding rows past the sequences' tokens (one sequence of 0)


def test_golden_is_the_fixed_layout_one_sequence_at_a_time():
    _, x = _inputs(4)
    kc, vc, q_rope = _golden(x)
    cos, sin = x["table"][..., 0], x["table"][..., 1]
    for i, (first, n) in enumerate(zip(x["seq_start"], x["seq_len"])):
        rows = slice(first, first + n)
        *_, want = ref.kv_update(x["k_cache"], x["v_cache"], x["k_new"][None, rows], x["v_new"][None, rows],
                                 x["pos"][i:i + 1], cos, sin, block_table=x["block_table"],
                                 cache_loc=x["cache_loc"][i:i + 1], q=x["q"][None, rows])
        assert np.array_equal(q_rope[rows], want[0])
    assert np.isnan(q_rope[~_owned(x)]).all() and not np.isnan(q_rope[_owned(x)]).any()
    # at the flattened row instead of pos[b] + t: other values
    flat = ref.rope(x["q"].astype(np.float64), cos, sin, np.arange(24), style="half", rot=16)
    assert not np.allclose(flat[_owned(x)], q_rope[_owned(x)])
    with pytest.raises(ValueError, match="holding every sequence's rows"):
        ref.kv_update(x["k_cache"], x["v_cache"], x["k_new"], x["v_new"], x["pos"], cos, sin,
                      block_table=x["block_table"], cache_loc=x["cache_loc"], q=x["q"][:int(_owned(x).sum()) - 1],
                      seq_len=x["seq_len"], seq_start=x["seq_start"])


def test_c_kernel_writes_the_owned_rows_bitwise_as_the_fixed_layout_and_leaves_the_rest():
    from kernel_parity.kernels.cpu import rope as k

    _, x = _inputs(4, dtype="bf16")
    own = _owned(x)
    kc, vc = x["k_cache"].copy(), x["v_cache"].copy()
    q_out = np.full_like(x["q"], 7.0)
    k.kv_update(kc, vc, x["k_new"], x["v_new"], x["pos"], x["table"], block_table=x["block_table"],
                cache_loc=x["cache_loc"], q=x["q"], q_out=q_out, seq_len=x["seq_len"], seq_start=x["seq_start"])
    assert (q_out[~own].astype(np.float32) == 7.0).all()
    for i, (first, n) in enumerate(zip(x["seq_start"], x["seq_len"])):
        rows = slice(first, first + n)
        one = k.kv_update(x["k_cache"].copy(), x["v_cache"].copy(), x["k_new"][None, rows], x["v_new"][None, rows],
                          x["pos"][i:i + 1], x["table"], block_table=x["block_table"],
                          cache_loc=x["cache_loc"][i:i + 1], q=x["q"][None, rows])
        assert np.array_equal(q_out[rows].view(np.uint16), one[0].view(np.uint16))
    *_, want = _golden(x)
    np.testing.assert_allclose(q_out[own].astype(np.float64), want[own], rtol=2.0**-7, atol=2.0**-7)
    with pytest.raises(ValueError, match="holding every sequence's rows"):
        k.kv_update(kc, vc, x["k_new"], x["v_new"], x["pos"], x["table"], block_table=x["block_table"],
                    cache_loc=x["cache_loc"], q=x["q"][:int(own.sum()) - 1], seq_len=x["seq_len"],
                    seq_start=x["seq_start"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_and_triton_kernels_are_the_golden_on_the_owned_rows(backend):
    torch = pytest.importorskip("torch")
    if backend == "triton":
        from kernel_parity.conformance.backends.triton_prep import interpreter_ready, prepare_environment

        prepare_environment()
        why = interpreter_ready()
        if why:
            pytest.skip(why)
        from kernel_parity.kernels.triton.rope_kv import kv_update
    else:
        from kernel_parity.kernels.torch.rope import kv_update
    _, x = _inputs(4)
    own = _owned(x)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in x.items()}
    q_out = torch.full_like(t["q"], 7.0)
    kv_update(t["k_cache"], t["v_cache"], t["k_new"], t["v_new"], t["pos"], t["table"], block_table=t["block_table"],
              cache_loc=t["cache_loc"], q=t["q"], q_out=q_out, seq_len=t["seq_len"], seq_start=t["seq_start"])
    got = q_out.numpy()
    assert (got[~own] == 7.0).all()
    *_, want = _golden(x)
    np.testing.assert_allclose(got[own], want[own], rtol=1e-5, atol=1e-5)
