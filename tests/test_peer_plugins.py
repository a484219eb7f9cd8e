"""The `liger` and `quack` peer adapters without a GPU.

Fake `liger_kernel` and `quack` modules, injected into sys.modules, implement the entry points the
adapters call with the real signatures and conventions (liger-kernel 0.8.5, quack-kernels 0.6.5:
argument order, return tuples, casting modes and offsets, RoPE's in-place rotation of q's storage
and its (1, t, rot/2) cos / sin, the fused gate-first SwiGLU, LayerNorm's mandatory bias, quack's
fp32-only LayerNorm weight) and compute the same thing with plain torch on the CPU. Each adapter then
runs through the runner and is judged like any backend, so a wrong mapping (gate and up swapped,
Gemma's offset or casting mode lost, positions ignored, a return tuple misread, a rotation that
lands in a copy) fails here rather than on the lead's one GPU run.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from kernel_parity.conformance import ops  # noqa: E402
from kernel_parity.conformance.backends import Registry, claimed_reference  # noqa: E402
from kernel_parity.conformance.backends import liger as liger_plugin  # noqa: E402
from kernel_parity.conformance.backends import quack as quack_plugin  # noqa: E402
from kernel_parity.conformance.errors import UsageError  # noqa: E402
from kernel_parity.conformance.poison import BenchRequest  # noqa: E402
from kernel_parity.conformance.runner import Prepared, Runner  # noqa: E402

_MODES = {"llama": 0, "gemma": 1, "none": -1}


def _module(name: str, package: bool = False, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        m.__path__ = []
    m.__dict__.update(attrs)
    return m


def _fn(forward):
    """An autograd Function whose forward runs `forward` as given (the library's roundings) and whose
    backward, like liger's kernels, differentiates it in fp32 and casts each gradient to its input's dtype."""

    def floats(args):
        return [a.detach().float().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                for a in args]

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.args = args
            res = forward(*args)
            return tuple(r.clone() for r in res) if isinstance(res, tuple) else res.clone()

        @staticmethod
        def backward(ctx, *grads):
            args = ctx.args
            with torch.enable_grad():
                leaves = floats(args)
                res = forward(*[a.clone() if torch.is_tensor(a) and a.requires_grad else a for a in leaves])
                res = res if isinstance(res, tuple) else (res,)
                want = [i for i, a in enumerate(leaves) if torch.is_tensor(a) and a.requires_grad]
                got = torch.autograd.grad(res, [leaves[i] for i in want], [g.float() for g in grads],
                                          allow_unused=True)
            out = [None] * len(args)
            for i, g in zip(want, got):
                out[i] = None if g is None else g.to(args[i].dtype)
            return tuple(out)

    Fn.__name__ = forward.__name__
    return Fn


# -- a fake liger_kernel.ops ---------------------------------------------------------------------
def _rms(X, W, eps, offset, mode, R=None):
    assert mode in _MODES, f"invalid casting mode {mode!r}"
    X = X.contiguous()
    n = X.shape[-1]
    assert W.shape == (n,), f"W {tuple(W.shape)} does not match the hidden size {n}"
    S = X if R is None else (X + R.contiguous())  # liger sums in the storage dtype
    s32 = S.float()
    rstd = torch.rsqrt((s32 * s32).mean(-1) + eps)
    xn = s32 * rstd[..., None]
    if mode == "llama":  # x * rstd rounded to the dtype, the weight product in the dtype
        Y = xn.to(X.dtype) * (offset + W).to(X.dtype)
    else:
        Y = (xn * (offset + W.float())).to(X.dtype)
    return Y, S, rstd


def _liger_ops() -> types.ModuleType:
    def silu_mul(a, b, gate_multiplier=1.0, down_multiplier=1.0):
        a, b = a.contiguous(), b.contiguous()
        assert a.shape == b.shape
        return (F.silu(a.float() * gate_multiplier).to(b.dtype) * b) * down_multiplier

    def fused_gate_up(y, in_place=False):
        assert y.shape[-1] % 2 == 0, "fused gate-up input must have an even trailing dim"
        gate, up = y.contiguous().chunk(2, dim=-1)
        return F.silu(gate.float()).to(up.dtype) * up

    def gelu_mul(a, b):
        a, b = a.contiguous(), b.contiguous()
        return F.gelu(a.double(), approximate="tanh").to(b.dtype) * b

    def rms_norm_forward(X, W, eps, offset, casting_mode, row_mode):
        Y, _, rstd = _rms(X, W, eps, offset, casting_mode)
        return Y, X, rstd, 64, 4, _MODES[casting_mode]

    def rms_norm_fn(X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        return _rms(X, W, eps, offset, casting_mode)[0]

    def fused_add_rms_norm_forward(X, R, W, eps, offset, casting_mode):
        Y, S, rstd = _rms(X, W, eps, offset, casting_mode, R)
        return Y, S, rstd, 64, 4, 2, _MODES[casting_mode]

    def fused_add_rms_norm_fn(X, R, W, eps, offset=0.0, casting_mode="llama", in_place=False):
        Y, S, _ = _rms(X, W, eps, offset, casting_mode, R)
        return Y, S

    def layer_norm_forward(X, W, B, eps):
        X = X.contiguous()
        assert B is not None, "liger's LayerNorm kernel reads a bias"  # B.stride(0) in the real launcher
        x = X.float()
        mean = x.mean(-1)
        c = x - mean[..., None]
        rstd = torch.rsqrt((c * c).mean(-1) + eps)
        Y = (c * rstd[..., None] * W.float() + B.float()).to(X.dtype)
        return Y, X, mean, rstd, 64, 4

    def layer_norm_fn(X, W, B, eps):
        return layer_norm_forward(X, W, B, eps)[0]

    def rope_fn(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        if cos.ndim == 2:
            cos, sin = cos[None], sin[None]
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # no-op for HF's layout
        hd = q.shape[-1]
        rd = min(cos.shape[-1], hd) if rotary_dim is None else rotary_dim
        assert rd % 2 == 0 and 0 < rd <= hd and cos.shape[-1] >= rd // 2
        c, s = cos[..., : rd // 2][:, :, None, :], sin[..., : rd // 2][:, :, None, :]  # bs, seq, 1, rd/2
        for t in (q, k):  # rotated in place, computed in cos / sin's dtype
            x1, x2 = t[..., : rd // 2].to(cos.dtype).clone(), t[..., rd // 2: rd].to(cos.dtype).clone()
            t[..., : rd // 2], t[..., rd // 2: rd] = (x1 * c - x2 * s).to(t.dtype), (x2 * c + x1 * s).to(t.dtype)
        return q.transpose(1, 2), k.transpose(1, 2)

    return _module(
        "liger_kernel.ops",
        LigerSiLUMulFunction=_fn(silu_mul), LigerFusedGateUpSiLUMulFunction=_fn(fused_gate_up),
        LigerGELUMulFunction=_fn(gelu_mul), LigerRMSNormFunction=_fn(rms_norm_fn),
        rms_norm_forward=rms_norm_forward, LigerFusedAddRMSNormFunction=_fn(fused_add_rms_norm_fn),
        fused_add_rms_norm_forward=fused_add_rms_norm_forward, LigerLayerNormFunction=_fn(layer_norm_fn),
        layer_norm_forward=layer_norm_forward, LigerRopeFunction=_fn(rope_fn),
    )


# -- a fake quack.rmsnorm ------------------------------------------------------------------------
def _quack_rmsnorm() -> types.ModuleType:
    def rmsnorm_fwd(x, weight=None, bias=None, residual=None, out_dtype=None, residual_dtype=None, eps=1e-6,
                    store_rstd=False, weight_offset=0.0):
        assert x.stride(-1) == 1 and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        assert weight_offset == 0.0 or weight is not None
        s = x.float() if residual is None else x.float() + residual.float()  # summed in fp32
        rstd = torch.rsqrt((s * s).mean(-1) + eps)
        y = s * rstd[..., None]
        if weight is not None:
            y = y * (weight.float() + weight_offset)
        if bias is not None:
            y = y + bias.float()
        out = y.to(out_dtype or x.dtype)
        res = x if residual is None else s.to(residual_dtype or residual.dtype)
        return out, res, rstd if store_rstd else None

    def layernorm_fwd(x, weight, bias=None, eps=1e-6, return_rstd=False, return_mean=False):
        assert x.dim() == 2 and weight.dim() == 1
        assert weight.dtype == torch.float32, "Weight must be float32"
        assert bias is None or bias.dtype == torch.float32, "Bias must be float32"
        xf = x.float()
        mean = xf.mean(-1)
        c = xf - mean[..., None]
        rstd = torch.rsqrt((c * c).mean(-1) + eps)
        y = c * rstd[..., None] * weight
        out = (y if bias is None else y + bias).to(x.dtype)
        if return_rstd and return_mean:
            return out, rstd, mean
        if return_rstd:
            return out, rstd
        if return_mean:
            return out, mean
        return out

    return _module("quack.rmsnorm", rmsnorm_fwd=rmsnorm_fwd, layernorm_fwd=layernorm_fwd)


@pytest.fixture
def fakes(monkeypatch):
    lk_ops = _liger_ops()
    q_rms = _quack_rmsnorm()
    for name, mod in (("liger_kernel", _module("liger_kernel", True, ops=lk_ops)), ("liger_kernel.ops", lk_ops),
                      ("quack", _module("quack", True, rmsnorm=q_rms)), ("quack.rmsnorm", q_rms),
                      ("cutlass", _module("cutlass", True))):
        monkeypatch.setitem(sys.modules, name, mod)


def _runner(*backends) -> Runner:
    registry = Registry()
    for b in backends:
        registry.add(b)
    return Runner(registry, recheck=False, noise=False, diagnose=False)


def _grid(**axes) -> list[dict]:
    out = [{}]
    for k, vals in axes.items():
        out = [{**p, k: v} for p in out for v in (vals if isinstance(vals, (list, tuple)) else [vals])]
    return out


RMS = _grid(rows=3, n=[64, 113], pad=0, eps="1e-6", gemma=[0, 1], residual=[0, 1], rstd=[0, 1])
LN = _grid(rows=3, n=[64, 113], pad=0, eps="1e-5", bias=[0, 1], stats=[0, 1])
ROPE = (_grid(t=5, h=3, d=64, rot=[64, 32], style="half", at="first", table=["cos_sin", "cs_f16", "cis"], theta=10000,
              scaling="none", maxseq=40, pos=["ragged", "random"], start=0)
        + _grid(t=4, h=2, d=32, rot=32, style="half", at="last", table="cos_sin", theta=500000, scaling="llama3",
                maxseq=64, pos="offset", start=9))
SWIGLU = _grid(t=3, i=[1, 113], layout=["fused", "split"])
GEGLU = _grid(t=3, i=[1, 113], layout=["fused", "split"], approx="tanh")
_LIGER = {"norm.rms_norm": RMS, "norm.layer_norm": LN, "rope.rope": ROPE, "mlp.swiglu": SWIGLU, "mlp.geglu": GEGLU}
CASES = {"liger": {**_LIGER, **{f"{op}_backward": grid for op, grid in _LIGER.items()}},
         "quack": {"norm.rms_norm": RMS, "norm.layer_norm": LN}}


@pytest.mark.parametrize("plugin", ["liger", "quack"])
def test_adapters_compute_the_op_through_the_fake_library(fakes, plugin):
    backend = {"liger": liger_plugin, "quack": quack_plugin}[plugin].make(device="cpu")
    runner = _runner(backend)
    seen = 0
    for op, params in CASES[plugin].items():
        for p in params:
            for dtype in ("fp32", "bf16"):
                if plugin == "liger" and op.startswith("norm.rms_norm") and p["residual"] and dtype != "fp32" \
                        and (p["rstd"] or op.endswith("_backward")):
                    continue  # liger sums x + r in the storage dtype: its fp32 rstd is that of the rounded h
                dist = "heads" if op.startswith("rope.rope") else ("halves" if op.startswith("mlp") else "scales")
                for d in ("normal", dist):
                    case = ops.make_case(op, plugin, dtype, p, d, 3)
                    rec = runner.evaluate(case)
                    want = "skip" if backend.supports(case) else "pass"  # quack: 16-bit rows of odd width
                    assert rec.verdict == want, f"{rec.id}: {rec.verdict} {rec.message or rec.reason}"
                    seen += want == "pass"
    assert seen >= sum(len(v) for v in CASES[plugin].values())


def _case(op: str, backend: str, **p):
    base = {"norm.rms_norm": RMS[0], "norm.layer_norm": LN[0], "rope.rope": ROPE[0], "mlp.swiglu": SWIGLU[0],
            "mlp.geglu": GEGLU[0]}[op]
    return ops.make_case(op, backend, "bf16", {**base, **p}, "normal", 0)


@pytest.mark.parametrize("op, change, reason", [
    ("norm.rms_norm", dict(pad=16), "no real width inside an aligned row"),
    ("norm.layer_norm", dict(pad=1), "no real width inside an aligned row"),
    ("norm.rms_norm", dict(n=70000), "next_pow2(n=70000) > 65536"),
    ("rope.rope", dict(style="interleaved"), "not interleaved pairs"),
    ("rope.rope", dict(rot=32, at="last"), "partial rotary at the start only"),
    ("rope.rope", dict(table="theta"), "builds no angles from theta"),
    ("mlp.geglu", dict(approx="erf"), "tanh approximation only"),
    ("mlp.swiglu", dict(i=65537), "next_pow2(i=65537) > 65536"),
    ("rope.kv_update", None, "liger has no kernel for rope.kv_update"),
])
def test_liger_says_what_it_cannot_express(op, change, reason):
    backend = liger_plugin.make(device="cpu")
    case = types.SimpleNamespace(op=op, dtype="bf16", p={}) if change is None else _case(op, "liger", **change)
    assert reason in (backend.supports(case) or "")


def test_quack_says_what_it_cannot_express():
    backend = quack_plugin.make(device="cpu")
    assert "no real width inside an aligned row" in backend.supports(_case("norm.rms_norm", "quack", pad=1))
    assert "a 16-bit row needs an even width, n=113" in backend.supports(_case("norm.rms_norm", "quack", n=113))
    assert "quack has no kernel for mlp.swiglu" in backend.supports(_case("mlp.swiglu", "quack"))
    assert backend.supports(_case("norm.rms_norm", "quack", gemma=1, residual=1, rstd=1)) is None


def test_available_names_the_missing_piece(fakes, monkeypatch):
    from kernel_parity.conformance.backends import _torch

    monkeypatch.setattr(_torch, "cuda_available", lambda: False)
    monkeypatch.setattr(liger_plugin, "cuda_available", lambda: False)
    monkeypatch.setattr(quack_plugin, "cuda_available", lambda: False)
    assert liger_plugin.make().available().startswith("liger needs a CUDA GPU")
    assert quack_plugin.make().available().startswith("quack needs a CUDA GPU")
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # find_spec: not installed
    monkeypatch.setitem(sys.modules, "cutlass", None)
    assert liger_plugin.make().available() == "liger-kernel is not installed (pip install 'kernel-parity[peers]')"
    assert quack_plugin.make().available() == "nvidia-cutlass-dsl is not installed (pip install 'kernel-parity[peers]')"


def test_entry_points_load_the_plugins():
    registry = Registry()
    for name in ("liger", "quack", "fa4"):
        b = registry.get(name)
        assert b.name == name and b.device == "cuda"
        assert not getattr(b, "triton", False)


# -- flash-attn-4 (fa4): a fake flash_attn.cute with FlashAttention's conventions -----------------------
def _fa_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, window_size=(None, None),
             learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
             score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None,
             block_sparse_tensors_bwd=None, return_lse=False, gather_bwd_recompute_p=False,
             gather_bwd_token_chunk=None):
    """flash_attn.cute.flash_attn_func on the CPU: (b, s, h, d) tensors, GQA by h_q % h_kv, causal and
    windows bottom-right aligned, softcap on the scaled logits, the sink's mass in the LSE, and
    FlashAttention-2's +inf LSE for an empty row (which the adapter must read as -inf)."""
    assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    assert h_q % h_kv == 0 and v.shape[:3] == k.shape[:3]
    g = h_q // h_kv
    kk, vv = k.float().repeat_interleave(g, dim=2), v.float().repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * (softmax_scale or d ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window_size
    right = 0 if causal else right
    i, j, off = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :], s_k - s_q
    keep = torch.ones(s_q, s_k, dtype=torch.bool)
    if left is not None:
        keep &= j >= i + off - left
    if right is not None:
        keep &= j <= i + off + right
    s = s.masked_fill(~keep, float("-inf"))
    if learnable_sink is not None:
        s = torch.cat([s, learnable_sink.float()[None, :, None, None].expand(b, h_q, s_q, 1)], dim=-1)
    # a differentiable softmax that leaves empty rows (O = 0, LSE = +inf here) without NaN gradients
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    tot = e.sum(dim=-1)
    live = tot > 0
    safe = torch.where(live, tot, torch.ones_like(tot))
    lse = torch.where(live, m[..., 0] + torch.log(safe), torch.full_like(tot, float("inf")))
    p = (e / safe[..., None])[..., :s_k]
    o = torch.einsum("bhqk,bkhd->bqhd", p, vv).to(q.dtype)
    return (o, lse) if return_lse else o


@pytest.fixture
def fa4_fake(monkeypatch):
    cute = _module("flash_attn.cute", True, flash_attn_func=_fa_func)
    monkeypatch.setitem(sys.modules, "flash_attn", _module("flash_attn", True, cute=cute))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)


def test_fa4_that_does_not_import_is_unavailable_saying_why(monkeypatch):
    """An install missing one of flash-attn-4's needs (4.0.0b36 imports quack) is a skip naming the import
    error, asked once per process, not an error in every case."""
    from kernel_parity.conformance.backends import flash_attn4

    monkeypatch.setattr(flash_attn4, "_installed", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import_module raises ModuleNotFoundError
    flash_attn4._import_error.cache_clear()
    try:
        why = flash_attn4.make(device="cpu").available()
        assert why.startswith("flash-attn-4 is installed but does not import (ModuleNotFoundError") and "quack" in why
    finally:
        flash_attn4._import_error.cache_clear()


FA_CASES = _grid(b=2, sq=[5, 9], sk=[9, 4], hq=4, hkv=[1, 2, 4], d=64, causal=["bottom_right", "none", "top_left"],
                 wl=[-1, 3], wr=[-1, 2], cap=[0, 30], sink=[0, 1])


def test_fa4_adapter_computes_prefill_through_the_fake_library(fa4_fake):
    from kernel_parity.conformance.backends import flash_attn4

    backend = flash_attn4.make(device="cpu")
    runner = _runner(backend)
    seen = {"pass": 0, "skip": 0}
    for p in FA_CASES:
        for dtype in ("bf16", "fp16"):
            try:
                case = ops.make_case("attention.prefill", "fa4", dtype, p, "normal", 1)
            except UsageError:  # not a case the op defines (a right window beside causal)
                continue
            rec = runner.evaluate(case)
            want = "skip" if backend.supports(case) else "pass"
            assert rec.verdict == want, f"{rec.id}: {rec.verdict} {rec.message or rec.reason}"
            seen[want] += 1
            lse = rec.to_json()["outputs"].get("lse") or {}
            if want == "pass" and p["sink"]:  # o judged, the LSE with the sink's mass reported as such
                assert "includes the sink's mass" in lse.get("not_provided", "")
            elif want == "pass":
                assert "not_provided" not in lse and lse["metrics"]
    assert seen["pass"] > 200 and seen["skip"] > 0  # top_left with s_q != s_k


def test_fa4_backward_through_the_fake_library(fa4_fake):
    """dq, dk, dv (GQA summed by autograd), dsinks and the LSE cotangent through the fake's autograd,
    judged against the float64 VJP golden."""
    from kernel_parity.conformance.backends import flash_attn4

    backend = flash_attn4.make(device="cpu")
    runner = _runner(backend)
    seen = {"pass": 0, "skip": 0}
    grid = _grid(b=2, sq=[5, 9], sk=[9, 4], hq=4, hkv=[1, 2], d=64, causal=["bottom_right", "none"], wl=[-1, 3],
                 wr=-1, cap=[0, 30], sink=[0, 1], dlse=[0, 1])
    for p in grid:
        for dtype in ("bf16", "fp16"):  # bf16 sinks too: judged on the exact VJP, not through the case's bf16 O
            case = ops.make_case("attention.prefill_backward", "fa4", dtype, p, "normal", 2)
            assert claimed_reference(backend, case) == "exact"
            rec = runner.evaluate(case)
            want = "skip" if backend.supports(case) else "pass"
            assert rec.verdict == want, f"{rec.id}: {rec.verdict} {rec.message or rec.reason}"
            seen[want] += 1
            if want == "pass" and p["sink"]:
                assert rec.to_json()["outputs"]["dsinks"]["metrics"]
    assert seen["pass"] > 100 and seen["skip"] > 0  # sinks beside an LSE cotangent


def test_fa4_says_what_it_cannot_express(fa4_fake):
    from kernel_parity.conformance.backends import flash_attn4

    backend = flash_attn4.make(device="cpu")
    base = dict(FA_CASES[0])

    def why(dtype="bf16", **p):
        return backend.supports(ops.make_case("attention.prefill", "fa4", dtype, {**base, **p}, "normal", 0)) or ""

    assert "runs" in why("fp32") or "fp32" in why("fp32")
    assert "bottom-right aligned" in why(causal="top_left", sq=5, sk=9)
    assert why(causal="top_left", sq=9, sk=9) == ""
    assert "head dims of 8..256" in why(d=320)
    assert "fa4 has no kernel for attention.decode" in backend.supports(
        types.SimpleNamespace(op="attention.decode", dtype="bf16", p={}))


def test_liger_backward_is_timed_without_its_forward(fakes):
    """`parity bench` times a liger backward op through the backend's `timed` split: the forward runs once
    outside the timed call, which returns autograd's gradients for the case's cotangents (the ones the
    judged `run` adapter returns), and the record's perf says what was timed."""
    import torch

    backend = liger_plugin.make(device="cpu")
    runner = Runner(Registry(extra=[]), recheck=False, noise=False, diagnose=False, bench=True)
    runner.registry.add(backend)
    for op in ("norm.rms_norm", "norm.layer_norm", "rope.rope", "mlp.swiglu", "mlp.geglu"):
        for p in (CASES["liger"][op][0], CASES["liger"][op][-1]):
            case = ops.make_case(f"{op}_backward", "liger", "fp32", p, "normal", 5)
            prep = Prepared(ops.get(case.op), case)
            inputs = {k: v.copy() for k, v in prep.inputs.items()}
            call, what = backend.timed[case.op](case, inputs, BenchRequest({}, {}, {}, backend=backend, device="cpu"))
            got = call()
            want = backend.run(case, inputs, BenchRequest({}, {}, {}, backend=backend, device="cpu"))
            assert len(got) == len(want) and "forward ran once, untimed" in what
            for g, (name, w) in zip(got, want.items()):
                assert torch.equal(g, w), f"{case.id}: timed {name} differs from the adapter's"
            rec = runner.evaluate(case)
            assert rec.verdict == "pass" and rec.perf["timed"] == what and rec.perf["ms"] > 0, rec.id
