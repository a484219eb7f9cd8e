"""Adapters binding the fused transformer blocks of each built-in backend to `blocks.*`, and the
reference each claims.

- cpu:    kernels/cpu/blocks.c: the fused decode block in one pass (blocks_attention_decode) and the
          prefill / MLP / outproj+MLP blocks stage by stage over the same C stages; integer block dots
          on ggml's activation quantizers: claims `emulated` (L2)
- triton: kernels/triton/blocks.py: each block composed of our Triton kernels (weights dequantized in
          registers, float products): claims `dequant` (L1)
- torch:  kernels/torch/blocks.py: eager, stage by stage, weights dequantized: claims `dequant` (L1)
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_parity.conformance.backends._torch import to_torch

DECODE, PREFILL, MLP, OUTPROJ_MLP = ("blocks.attention_decode", "blocks.attention_prefill", "blocks.mlp",
                                     "blocks.outproj_mlp")
OPS = (DECODE, PREFILL, MLP, OUTPROJ_MLP)
ATTENTION_STAGES = ("norm", "q", "k", "v", "q_rope", "k_rope", "attn", "out")
BIASES = (("bq", "bq"), ("bk", "bk"), ("bv", "bv"), ("bo", "bo"), ("r", "residual"))


def _wo_fmt(p: dict[str, Any]) -> str:
    return "f32_heads" if p.get("wo_layout") == "head_major" else p["wo"]


def _attention_args(case, t: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """(positional, keyword) arguments of the attention blocks, shared by the torch and Triton paths;
    `t` holds the case's tensors."""
    p = case.p
    start = p["pos"] if "pos" in p else p["start"]
    args = (t["x"], t["gamma"], float(p["eps"]), (p["wqkv"], t["wq"]), (p["wqkv"], t["wk"]), (p["wqkv"], t["wv"]),
            (p["wo"], t["wo"]), t["k_cache"], t["v_cache"], t["cos"], t["sin"], start)
    kw = dict(n=p["e"], h_q=p["hq"], h_kv=p["hkv"], d=p["d"], style=p["style"], gemma=bool(p["gemma"]),
              **{k: t.get(name) for name, k in BIASES})
    return args, kw


def _mlp_args(case, t: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    p = case.p
    return ((t["x"], t["gamma"], float(p["eps"]), (p["w1"], t["w1"]), (p["w2"], t["w2"])),
            dict(n=p["e"], gemma=bool(p["gemma"])))


def _outproj_mlp_args(case, t: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    p = case.p
    return ((t["attn"], t["residual"], (_wo_fmt(p), t["wo"]), t["gamma"], float(p["eps"]), (p["w1"], t["w1"]),
             (p["w2"], t["w2"])), dict(n=p["e"], bo=t.get("bo"), gemma=bool(p["gemma"])))


def _torch_results(out: Any, device: str, res: dict[str, Any]) -> dict[str, Any]:
    """Each output copied into its poisoned buffer."""
    got = {}
    for name, value in res.items():
        buf = out.torch(name, device)
        buf.copy_(value)
        got[name] = buf
    return got


def _torch_path(device: str, module: str) -> dict[str, Callable]:
    """Adapters over a kernels module with the torch path's functions (kernels/torch/blocks.py's
    signatures), imported when a case runs."""
    import importlib

    def attention(fn_name: str):
        def run(case, inputs, out):
            t = {k: to_torch(v, device) for k, v in inputs.items()}
            args, kw = _attention_args(case, t)
            res = getattr(importlib.import_module(module), fn_name)(*args, **kw)
            return {**_torch_results(out, device, res), "k_cache": t["k_cache"], "v_cache": t["v_cache"]}

        return run

    def rows(fn_name: str, build):
        def run(case, inputs, out):
            t = {k: to_torch(v, device) for k, v in inputs.items()}
            args, kw = build(case, t)
            return _torch_results(out, device, getattr(importlib.import_module(module), fn_name)(*args, **kw))

        return run

    return {DECODE: attention("attention_decode"), PREFILL: attention("attention_prefill"),
            MLP: rows("mlp", _mlp_args), OUTPROJ_MLP: rows("outproj_mlp", _outproj_mlp_args)}


def torch_ops(device: str) -> dict[str, Callable]:
    return _torch_path(device, "kernel_parity.kernels.torch.blocks")


def torch_claims() -> dict[str, Any]:
    return {op: "dequant" for op in OPS}


def _numpy_results(out: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: out.numpy(name) for name in names}


def cpu_ops() -> dict[str, Callable]:
    def attention(fn_name: str):
        def run(case, inputs, out):
            from kernel_parity.kernels.cpu import blocks as k

            args, kw = _attention_args(case, inputs)
            res = _numpy_results(out, ATTENTION_STAGES)
            getattr(k, fn_name)(*args, **kw, out=res)
            return {**res, "k_cache": inputs["k_cache"], "v_cache": inputs["v_cache"]}

        return run

    def rows(fn_name: str, build, names: tuple[str, ...]):
        def run(case, inputs, out):
            from kernel_parity.kernels.cpu import blocks as k

            args, kw = build(case, inputs)
            res = _numpy_results(out, names)
            getattr(k, fn_name)(*args, **kw, out=res)
            return res

        return run

    mlp_names = ("norm", "h", "act", "down", "out")
    return {DECODE: attention("attention_decode"), PREFILL: attention("attention_prefill"),
            MLP: rows("mlp", _mlp_args, mlp_names),
            OUTPROJ_MLP: rows("outproj_mlp", _outproj_mlp_args, ("proj", "h1") + mlp_names)}


def cpu_claims() -> dict[str, Any]:
    return {op: "emulated" for op in OPS}


TRITON_FORMATS = ("f32", "q8_0", "q4_k", "q6_k")  # the Triton GEMMs' GGML formats among the blocks', and fp32


def triton_ops(device: str) -> dict[str, Callable]:
    def attention(fn_name: str):
        def run(case, inputs, out):
            from kernel_parity.kernels.triton import blocks as k

            t = {name: to_torch(v, device) for name, v in inputs.items()}
            args, kw = _attention_args(case, t)
            res = {name: out.torch(name, device) for name in ATTENTION_STAGES}
            getattr(k, fn_name)(*args, **kw, out=res)
            return {**res, "k_cache": t["k_cache"], "v_cache": t["v_cache"]}

        return run

    def rows(fn_name: str, build, names: tuple[str, ...]):
        def run(case, inputs, out):
            from kernel_parity.kernels.triton import blocks as k

            t = {name: to_torch(v, device) for name, v in inputs.items()}
            args, kw = build(case, t)
            res = {name: out.torch(name, device) for name in names}
            getattr(k, fn_name)(*args, **kw, out=res)
            return res

        return run

    mlp_names = ("norm", "h", "act", "down", "out")
    return {DECODE: attention("attention_decode"), PREFILL: attention("attention_prefill"),
            MLP: rows("mlp", _mlp_args, mlp_names),
            OUTPROJ_MLP: rows("outproj_mlp", _outproj_mlp_args, ("proj", "h1") + mlp_names)}


def triton_claims() -> dict[str, Any]:
    return {op: "dequant" for op in OPS}


def triton_supports() -> dict[str, Callable]:
    def check(case) -> str | None:
        fmts = [case.p[k] for k in ("wqkv", "wo", "w1", "w2") if k in case.p]
        bad = sorted({f for f in fmts if f not in TRITON_FORMATS})
        if bad:
            return (f"the Triton blocks take {', '.join(TRITON_FORMATS)} weights (the Triton GEMMs' GGML formats "
                    f"and fp32), not {', '.join(bad)}")
        return None

    return {op: check for op in OPS}
