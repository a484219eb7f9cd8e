"""Self-tests of refimpl/rope.py against independent float64 constructions: Meta's complex multiply
(interleaved pairs), HF's rotate_half (half pairs), Llama-3.1's apply_scaling written out scalar by
scalar from the published formula, and kv_update against rope + kvcache.update."""

import math

import numpy as np
import pytest

from kernel_parity.refimpl import kvcache
from kernel_parity.refimpl import rope as ref

F64_REL = 1e-13  # the same products and sums in another order: a few ulps of the largest term


def _close(got, want, what, rel=F64_REL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want)
    tol = rel * max(np.abs(want).max(initial=0), 1e-300)
    where = np.unravel_index(err.argmax(), err.shape) if err.size else ()
    assert err.max(initial=0) <= tol, f"{what}: max |d| = {err.max(initial=0):.3e} > {tol:.3e} at {where}"


def _case(rng, t=6, h=3, d=32, rot=16, maxseq=50, theta=10000.0, scaling="none"):
    x = rng.standard_normal((t, h, d))
    pos = rng.integers(0, maxseq, t)
    cos, sin = ref.tables(maxseq, rot, theta, scaling)
    return x, pos, cos, sin


def _angles(pos, rot, theta, scaling="none"):
    """(t, rot/2) angles p w_i, the frequencies written out independently of inv_freq."""
    w = np.array([theta ** (-(2.0 * i) / rot) for i in range(rot // 2)])
    if scaling == "llama3":
        w = np.array([_meta_apply_scaling(f) for f in w])
    return np.asarray(pos, dtype=np.float64)[:, None] * w[None, :]


def _meta_apply_scaling(freq, factor=8.0, low=1.0, high=4.0, orig=8192):
    """Llama-3.1's apply_scaling for one frequency, as its published formula reads (scalar branches)."""
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / freq
    if wavelen < high_wavelen:
        return freq
    if wavelen > low_wavelen:
        return freq / factor
    smooth = (orig / wavelen - low) / (high - low)
    return (1 - smooth) * freq / factor + smooth * freq


@pytest.mark.parametrize("at", ["first", "last"])
@pytest.mark.parametrize("rot", [2, 16, 32])
def test_interleaved_is_metas_complex_multiply(at, rot):
    rng = np.random.default_rng(rot)
    x, pos, cos, sin = _case(rng, rot=rot)
    d = x.shape[-1]
    lo = 0 if at == "first" else d - rot
    part = x[..., lo:lo + rot]
    xc = part[..., 0::2] + 1j * part[..., 1::2]  # t, h, rot/2
    freqs_cis = np.exp(1j * _angles(pos, rot, 10000.0))[:, None, :]
    rotated = xc * freqs_cis
    want = x.copy()
    want[..., lo:lo + rot] = np.stack([rotated.real, rotated.imag], axis=-1).reshape(part.shape)
    _close(ref.rope(x, cos, sin, pos, style="interleaved", rot=rot, at=at), want, f"interleaved rot={rot} at={at}")


@pytest.mark.parametrize("at", ["first", "last"])
@pytest.mark.parametrize("rot", [2, 16, 32])
def test_half_is_hfs_rotate_half(at, rot):
    rng = np.random.default_rng(100 + rot)
    x, pos, cos, sin = _case(rng, rot=rot)
    d = x.shape[-1]
    lo = 0 if at == "first" else d - rot
    ang = _angles(pos, rot, 10000.0)
    emb = np.concatenate([ang, ang], axis=-1)[:, None, :]  # HF: cat(freqs, freqs)
    part = x[..., lo:lo + rot]
    rotate_half = np.concatenate([-part[..., rot // 2:], part[..., : rot // 2]], axis=-1)
    want = x.copy()
    want[..., lo:lo + rot] = part * np.cos(emb) + rotate_half * np.sin(emb)
    _close(ref.rope(x, cos, sin, pos, style="half", rot=rot, at=at), want, f"half rot={rot} at={at}")


def test_the_two_styles_agree_on_one_pair():
    """rot = 2: one pair, (x[0], x[1]) in both styles."""
    rng = np.random.default_rng(7)
    x, pos, cos, sin = _case(rng, d=5, rot=2)
    a = ref.rope(x, cos, sin, pos, style="half", rot=2, at="last")
    b = ref.rope(x, cos, sin, pos, style="interleaved", rot=2, at="last")
    assert np.array_equal(a, b)


@pytest.mark.parametrize("theta", [10000.0, 500000.0, 1000000.0])
@pytest.mark.parametrize("rot", [64, 128])
def test_llama3_scaling_is_the_published_formula(theta, rot):
    f = theta ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    want = np.array([_meta_apply_scaling(v) for v in f])
    _close(ref.llama3_scaling(f), want, f"llama3_scaling theta={theta} rot={rot}", rel=0)
    _close(ref.inv_freq(rot, theta, "llama3"), want, f"inv_freq llama3 theta={theta} rot={rot}")


def test_llama3_scaling_bands_at_llama31_8b():
    """Llama-3.1-8B (theta 500000, head dim 128): high frequencies kept, low ones / 8, a smooth band."""
    f = ref.inv_freq(128, 500000.0)
    g = ref.llama3_scaling(f)
    wavelen = 2 * np.pi / f
    keep, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert keep.any() and low.any() and (~keep & ~low).any()
    assert np.array_equal(g[keep], f[keep]) and np.array_equal(g[low], f[low] / 8)
    mid = ~keep & ~low
    assert np.all((g[mid] < f[mid]) & (g[mid] > f[mid] / 8))


def test_tables_are_cos_and_sin_of_position_times_frequency():
    cos, sin = ref.tables(40, 32, 500000.0, "llama3")
    ang = _angles(np.arange(40), 32, 500000.0, "llama3")
    _close(cos, np.cos(ang), "cos table")
    _close(sin, np.sin(ang), "sin table")
    assert np.array_equal(cos[0], np.ones(16)) and np.array_equal(sin[0], np.zeros(16))


def test_dims_outside_the_rotary_part_are_x_bit_for_bit():
    rng = np.random.default_rng(3)
    x, pos, cos, sin = _case(rng, d=40, rot=16)
    for at, outside in (("first", np.s_[..., 16:]), ("last", np.s_[..., :24])):
        for style in ref.STYLES:
            y = ref.rope(x, cos, sin, pos, style=style, rot=16, at=at)
            assert np.array_equal(y[outside].view(np.uint64), x[outside].view(np.uint64)), (style, at)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_kv_update_is_rope_then_kvcache_update(layout):
    rng = np.random.default_rng(11)
    b, s_new, h, d, smax, page = 3, 5, 2, 16, 24, 8
    k_new, v_new = rng.standard_normal((2, b, s_new, h, d))
    pos = rng.integers(0, smax - s_new + 1, b)
    cos, sin = ref.tables(smax, d, 10000.0)
    if layout == "paged":
        table = rng.permutation(b * smax // page + 2)[: b * smax // page].reshape(b, smax // page)
        k_cache, v_cache = rng.standard_normal((2, b * smax // page + 2, page, h, d))
    else:
        table = None
        k_cache, v_cache = rng.standard_normal((2, b, smax, h, d))
    kc, vc = ref.kv_update(k_cache, v_cache, k_new, v_new, pos, cos, sin, block_table=table)
    # k at position pos[b] + t, one sequence and one token at a time
    k_rot = np.stack([ref.rope(k_new[i], cos, sin, pos[i] + np.arange(s_new), style="half") for i in range(b)])
    assert np.array_equal(kc, kvcache.update(k_cache, k_rot, pos, block_table=table))
    assert np.array_equal(vc, kvcache.update(v_cache, v_new, pos, block_table=table))


def test_kv_update_q_is_rope_at_each_tokens_position():
    """TensorRT-LLM's q_rope: every query head (h_q = 3 h_kv) rotated at pos[b] + t, the caches as without q."""
    rng = np.random.default_rng(12)
    b, s_new, h, d, smax, page = 3, 5, 2, 16, 24, 8
    k_new, v_new = rng.standard_normal((2, b, s_new, h, d))
    q = rng.standard_normal((b, s_new, 3 * h, d))
    pos = np.array([0, 9, 19])  # positions past a page: the cache slot p % page differs from p
    cos, sin = ref.tables(smax, d, 10000.0)
    table = rng.permutation(b * smax // page).reshape(b, smax // page)
    k_cache, v_cache = rng.standard_normal((2, b * smax // page, page, h, d))
    kc, vc, q_rope = ref.kv_update(k_cache, v_cache, k_new, v_new, pos, cos, sin, block_table=table, q=q)
    want = np.stack([ref.rope(q[i], cos, sin, pos[i] + np.arange(s_new), style="half") for i in range(b)])
    assert np.array_equal(q_rope, want)
    assert not np.allclose(q_rope[1:], q[1:])  # rotated (no position is 0 past the first sequence's first token)
    kc0, vc0 = ref.kv_update(k_cache, v_cache, k_new, v_new, pos, cos, sin, block_table=table)
    assert np.array_equal(kc, kc0) and np.array_equal(vc, vc0)
    with pytest.raises(ValueError, match="h_q"):
        ref.kv_update(k_cache, v_cache, k_new, v_new, pos, cos, sin, block_table=table, q=q[:, :, :5])


def test_kv_update_spec_rejects_q_heads_not_a_multiple_of_kv_heads():
    from kernel_parity.conformance import ops

    spec = ops.get("rope.kv_update")
    p = dict(b=2, snew=3, hkv=2, d=16, smax=20, layout="contiguous")
    assert spec.check({**p, "hq": 6}) is None
    why = spec.check({**p, "hq": 5})
    assert why is not None and "hq=5" in why and "multiple of hkv=2" in why


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_kv_update_ragged_is_each_sequence_written_alone(layout):
    """TensorRT-LLM's flattened tokens (seq_len / seq_start, one sequence of 0) and V's own head dim: the
    same caches as writing each sequence's tokens as a batch of one, at its own pos[b] + t."""
    from kernel_parity.conformance import ops

    spec = ops.get("rope.kv_update")
    p = spec.params.validate(spec.name, dict(b=4, snew=6, hkv=2, d=16, smax=40, layout=layout, rows=5,
                                             tokens="ragged", dv=12))
    x = spec.make_inputs(p, "fp32", "normal", np.random.default_rng(3))
    n, first = x["seq_len"], x["seq_start"]
    assert (n == 0).sum() == 1 and np.array_equal(first, np.cumsum(n) - n) and x["k_new"].shape[0] == n.sum()
    assert x["v_new"].shape[-1] == 12 and x["v_cache"].shape[-1] == 12
    cos, sin = x["table"][..., 0], x["table"][..., 1]
    kw = dict(block_table=x.get("block_table"))
    kc, vc = ref.kv_update(x["k_cache"], x["v_cache"], x["k_new"], x["v_new"], x["pos"], cos, sin,
                           cache_loc=x["cache_loc"], seq_len=n, seq_start=first, **kw)
    kc1, vc1 = x["k_cache"].astype(np.float64), x["v_cache"].astype(np.float64)
    for i in range(4):  # one sequence at a time, the fixed layout (b = 1)
        rows = slice(first[i], first[i] + n[i])
        kc1, vc1 = ref.kv_update(kc1, vc1, x["k_new"][None, rows], x["v_new"][None, rows], x["pos"][i:i + 1], cos,
                                 sin, cache_loc=x["cache_loc"][i:i + 1], **kw)
    assert np.array_equal(kc, kc1) and np.array_equal(vc, vc1)
    assert not np.array_equal(kc, x["k_cache"])  # written (and rotated: d of k, 12 of v)


def test_kv_update_spec_ragged_defaults_and_takes_q_as_the_flattened_buffer():
    from kernel_parity.conformance import ops

    p = dict(b=2, snew=3, hkv=2, d=16, smax=20, layout="contiguous")
    assert "tokens" not in ops.make_case("rope.kv_update", "cpu", "fp32", {**p, "tokens": "fixed", "dv": 0},
                                         "normal", 0).id
    spec = ops.get("rope.kv_update")  # S13 / S14: q_rope's shape is the params' (b * snew, hq, d)
    assert spec.output_shapes(spec.params.validate(spec.name, {**p, "hq": 4, "tokens": "ragged"}))["q_rope"] == \
        (6, 4, 16)


def test_cpu_kv_update_rejects_ragged_rows_outside_new():
    from kernel_parity.kernels.cpu import rope as k

    rng = np.random.default_rng(2)
    cache = rng.standard_normal((2, 8, 1, 16)).astype(np.float32)
    new = rng.standard_normal((5, 1, 16)).astype(np.float32)
    table = np.zeros((8, 8, 2), np.float16)
    before = cache.copy()
    with pytest.raises(ValueError, match=r"sequence 1's tokens new\[3 : 6\] must lie in k_new's 5 rows"):
        k.kv_update(cache, cache.copy(), new, new.copy(), np.array([0, 2], np.int32), table,
                    seq_len=np.array([3, 3], np.int32), seq_start=np.array([0, 3], np.int32))
    with pytest.raises(ValueError, match="go together"):
        k.kv_update(cache, cache.copy(), new, new.copy(), np.array([0, 2], np.int32), table,
                    seq_len=np.array([3, 2], np.int32))
    assert np.array_equal(cache, before)


@pytest.mark.parametrize("bad, match", [
    (dict(rot=3), "even"), (dict(rot=66), "d=64"), (dict(at="middle"), "first, last"),
    (dict(style="neox"), "interleaved, half"),
])
def test_bad_arguments_raise(bad, match):
    rng = np.random.default_rng(0)
    x, pos, cos, sin = _case(rng, d=64, rot=32)
    kw = dict(style="half", rot=32, at="first") | bad
    with pytest.raises(ValueError, match=match):
        ref.rope(x, cos, sin, pos, **kw)
    with pytest.raises(ValueError, match="llama3"):
        ref.inv_freq(32, 10000.0, "yarn")
