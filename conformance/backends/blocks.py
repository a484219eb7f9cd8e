"""Adapters binding the fused transformer blocks of each built-in backend to `blocks.*`, and the
reference each claims.

- cpu:    kernels/cpu/blocks.c: the fused decode block in one pass (blocks_attention_decode) and the
          prefill / MLP / outproj+MLP blocks stage by stage over the same C stages; integer block dots
          on ggml's activation quantizers: claims `emulated` (L2)
- triton: kernels/triton/blocks.py: each block composed of our Triton kernels (weights dequantized in
          registers, float products): claims `dequant` (L1)
- torch:  kernels/torch/blocks.py: eager, stage by stage, weights dequantized: claims `dequant` (L1)
`blocks.layer` (S9) composes each backend's attention and MLP blocks (C: blocks_layer in blocks.c; torch, Triton:
their `layer`); its saved scores come from the backend's own attention (C: its logits, final max and sum; torch:
the eager softmax), and the Triton layer, whose chunked_prefill never forms P, declares scores=1 unsupported.
The whole-layer backward (`blocks.mlp_backward`, `blocks.attention_prefill_backward`; one reference, L1):
cpu kernels/cpu/blocks_bwd.c (the seed's fp32 backward stage kernels), torch autograd through the eager
forward in fp32, triton kernels/triton/blocks_bwd.py (a composition of the families' Triton backward
kernels: gemm_bwd, norm_backward, mlp, rope, attention_bwd; a skip naming any that is missing).
`blocks.layer_backward` (S9) composes each backend's two block backwards (C: blocks_layer_backward; torch:
autograd through `layer`; Triton: blocks_bwd.layer_backward); scores=1 gives the forward's P, which the C
kernel reads in place of recomputing it and torch's `layer` uses forward and backward (`_SavedProbs`); the
Triton attention backward recomputes P from the LSE and declares scores=1 unsupported.
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_parity.conformance.backends._torch import to_torch

DECODE, PREFILL, MLP, OUTPROJ_MLP, LAYER = ("blocks.attention_decode", "blocks.attention_prefill", "blocks.mlp",
                                            "blocks.outproj_mlp", "blocks.layer")
OPS = (DECODE, PREFILL, MLP, OUTPROJ_MLP, LAYER)
MLP_BWD, PREFILL_BWD, LAYER_BWD = "blocks.mlp_backward", "blocks.attention_prefill_backward", "blocks.layer_backward"
SAVED_MLP = ("norm", "rstd", "h", "act")
SAVED_ATTENTION = ("norm", "rstd", "q_rope", "k_rope", "v", "attn")
# stage gradient -> the forward tensor (kernels/torch/blocks.py's stage outputs) whose gradient it is
MLP_GRAD_OF = {"dact": "act", "dh": "h", "dnorm": "norm"}
ATTENTION_GRAD_OF = {"dattn": "attn", "dq_rope": "q_rope", "dk_rope": "k_rope", "dv": "v", "dq": "q", "dk": "k",
                     "dnorm": "norm"}
LAYER_GRAD_OF = {"dact": "act", "dh": "h", "dnorm2": "norm2", "dh1": "h1",
                 **{k: v for k, v in ATTENTION_GRAD_OF.items()}}
# final gradient -> the input it differentiates
INPUT_OF = {"dgamma2": "gamma2", "dx": "x", "dgamma": "gamma", "dw1": "w1", "dw2": "w2", "dwq": "wq", "dwk": "wk", "dwv": "wv", "dwo": "wo",
            "dbq": "bq", "dbk": "bk", "dbv": "bv", "dbo": "bo", "dr": "r", "db1": "b1", "db2": "b2",
            "dwqkv": "wqkv", "dbqkv": "bqkv"}
ATTENTION_STAGES = ("norm", "q", "k", "v", "q_rope", "k_rope", "attn", "out")
BIASES = (("bq", "bq"), ("bk", "bk"), ("bv", "bv"), ("bo", "bo"), ("r", "residual"))


def _wo_fmt(p: dict[str, Any]) -> str:
    return "f32_heads" if p.get("wo_layout") == "head_major" else p["wo"]


def _attention_args(case, t: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """(positional, keyword) arguments of the attention blocks, shared by the torch and Triton paths;
    `t` holds the case's tensors."""
    p = case.p
    start = p["pos"] if "pos" in p else p["start"]
    fused = p.get("qkv") == "fused"  # the seed's one W_qkv / b_qkv, passed as wq / bq (wk, wv, bk, bv None)
    wqkv = (((p["wqkv"], t["wqkv"]), None, None) if fused
            else tuple((p.get(n) or p["wqkv"], t[n]) for n in ("wq", "wk", "wv")))  # S1: wk, wv their own formats
    args = (t["x"], t["gamma"], float(p["eps"]), *wqkv, (_wo_fmt(p), t["wo"]), t["k_cache"], t["v_cache"], t["cos"],
            t["sin"], start)
    kw = dict(n=p["e"], h_q=p["hq"], h_kv=p["hkv"], d=p["d"], style=p["style"], gemma=bool(p["gemma"]),
              **{k: t.get(name) for name, k in BIASES}, rope_off=p.get("rope_off", 0), qkv=p.get("qkv", "separate"))
    if fused:
        kw["bq"] = t.get("bqkv")
    return args, kw


LAYER_STAGES = ("norm", "q", "k", "v", "q_rope", "k_rope", "attn", "h1", "norm2", "h", "act", "down", "out")


def _layer_args(case, t: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The whole layer's (S9) arguments: the attention block's (no residual: it is x), then gamma2, w1, w2."""
    p = case.p
    args, kw = _attention_args(case, t)
    kw = {k: v for k, v in kw.items() if k not in ("residual", "rope_off", "qkv")}
    return (*args, t["gamma2"], (p["w1"], t["w1"]), (p["w2"], t["w2"])), kw


SAVED_LAYER_MLP = {"norm2": "norm2", "rstd2": "rstd2", "h": "h", "act": "act", "h1": "h1"}


def _layer_backward_kw(case, t: dict[str, Any]) -> dict[str, Any]:
    """layer_backward's keywords beyond the forward's: the saved activations, the scores (scores=1) and which
    blocks' weight gradients the case has (float32 blocks)."""
    from kernel_parity.conformance.ops.blocks_grad import f32_block

    saved = {n: t[n] for n in (*SAVED_ATTENTION, *SAVED_LAYER_MLP)}
    return dict(**saved, scores=t["scores"] if case.p.get("scores", 0) else None,
                attention_grads=f32_block(case.p, "wqkv", "wo"), mlp_grads=f32_block(case.p, "w1", "w2"))


def _layer_names(p: dict[str, Any]) -> tuple[str, ...]:
    return LAYER_STAGES + (("scores",) if p.get("scores", 0) else ())


def _mlp_kw(p: dict[str, Any], t: dict[str, Any]) -> dict[str, Any]:
    """The MLP's keywords: n, the biases b1, b2 (or None), the real intermediate width I (w1 has 2aI rows)."""
    return dict(n=p["e"], b1=t.get("b1"), b2=t.get("b2"), inter=p["i"], gemma=bool(p["gemma"]))


def _mlp_args(case, t: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    p = case.p
    return ((t["x"], t["gamma"], float(p["eps"]), (p["w1"], t["w1"]), (p["w2"], t["w2"])), _mlp_kw(p, t))


def _outproj_mlp_args(case, t: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    p = case.p
    return ((t["attn"], t["residual"], (_wo_fmt(p), t["wo"]), t["gamma"], float(p["eps"]), (p["w1"], t["w1"]),
             (p["w2"], t["w2"])),
            dict(bo=t.get("bo"), **_mlp_kw(p, t), attn_layout=p.get("attn_layout", "token_major")))


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

    def layer(case, inputs, out):
        t = {k: to_torch(v, device) for k, v in inputs.items()}
        args, kw = _layer_args(case, t)
        ctx = out.torch("scores", device).shape[-1] if case.p.get("scores", 0) else 0
        res = importlib.import_module(module).layer(*args, **kw, scores_ctx=ctx)
        return {**_torch_results(out, device, res), "k_cache": t["k_cache"], "v_cache": t["v_cache"]}

    return {DECODE: attention("attention_decode"), PREFILL: attention("attention_prefill"),
            MLP: rows("mlp", _mlp_args), OUTPROJ_MLP: rows("outproj_mlp", _outproj_mlp_args), LAYER: layer}


def torch_ops(device: str) -> dict[str, Callable]:
    ops = _torch_path(device, "kernel_parity.kernels.torch.blocks")
    ops.update({MLP_BWD: _torch_backward(device, MLP_BWD), PREFILL_BWD: _torch_backward(device, PREFILL_BWD),
                LAYER_BWD: _torch_backward(device, LAYER_BWD)})
    return ops


def _torch_backward(device: str, op: str) -> Callable:
    """Autograd through the eager forward (kernels/torch/blocks.py) in fp32: the stage gradients are those of
    the forward's stage tensors, the final ones those of the inputs (the float32 weights' only for a block
    whose weights are all float32). The caches are copied: the forward writes the new rows into them."""
    from kernel_parity.conformance.ops.blocks_grad import attention_grad_shapes, layer_grad_shapes, mlp_grad_shapes

    def run(case, inputs, out):
        import torch

        from kernel_parity.kernels.torch import blocks as k

        shapes = {MLP_BWD: mlp_grad_shapes, PREFILL_BWD: attention_grad_shapes,
                  LAYER_BWD: layer_grad_shapes}[op](case.p)
        t = {name: to_torch(v, device) for name, v in inputs.items()}
        for name in ("k_cache", "v_cache"):
            if name in t:
                t[name] = t[name].clone()
        leaves = {g: t[INPUT_OF[g]].requires_grad_() for g in shapes if g in INPUT_OF}
        with torch.enable_grad():
            if op == MLP_BWD:
                args, kw = _mlp_args(case, t)
                res, stage_of = k.mlp(*args, **kw), MLP_GRAD_OF
            elif op == LAYER_BWD:  # scores=1: the attention reads the given P, forward and backward
                args, kw = _layer_args(case, t)
                res = k.layer(*args, **kw, scores_in=t["scores"] if case.p.get("scores", 0) else None)
                stage_of = LAYER_GRAD_OF
            else:
                args, kw = _attention_args(case, t)
                res, stage_of = k.attention_prefill(*args, **kw), ATTENTION_GRAD_OF
            stages = {g: res[name] for g, name in stage_of.items()}
            grads = torch.autograd.grad(res["out"], [*stages.values(), *leaves.values()], t["dout"])
        return _torch_results(out, device, dict(zip([*stages, *leaves], grads)))

    return run


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

    def layer(case, inputs, out):
        from kernel_parity.kernels.cpu import blocks as k

        args, kw = _layer_args(case, inputs)
        res = _numpy_results(out, _layer_names(case.p))
        k.layer(*args, **kw, scores=bool(case.p.get("scores", 0)), out=res)
        return {**res, "k_cache": inputs["k_cache"], "v_cache": inputs["v_cache"]}

    mlp_names = ("norm", "h", "act", "down", "out")
    return {DECODE: attention("attention_decode"), PREFILL: attention("attention_prefill"),
            MLP: rows("mlp", _mlp_args, mlp_names),
            OUTPROJ_MLP: rows("outproj_mlp", _outproj_mlp_args, ("proj", "h1") + mlp_names), LAYER: layer,
            MLP_BWD: _cpu_backward(MLP_BWD), PREFILL_BWD: _cpu_backward(PREFILL_BWD), LAYER_BWD: _cpu_layer_backward}


def _cpu_layer_backward(case, inputs, out):
    """kernels/cpu/blocks_bwd.c's blocks_layer_backward: the two blocks' C backward composed (S9)."""
    from kernel_parity.conformance.ops.blocks_grad import layer_grad_shapes
    from kernel_parity.kernels.cpu import blocks_bwd as k

    args, kw = _layer_args(case, inputs)
    return k.layer_backward(*args, inputs["dout"], **kw, **_layer_backward_kw(case, inputs),
                            out=_numpy_results(out, tuple(layer_grad_shapes(case.p))))


def cpu_claims() -> dict[str, Any]:
    return {op: "emulated" for op in OPS}


def _cpu_backward(op: str) -> Callable:
    """kernels/cpu/blocks_bwd.c through its wrapper: the forward's arguments, the saved activations, dout."""
    from kernel_parity.conformance.ops.blocks_grad import (ATTENTION_WEIGHTS, attention_grad_shapes, f32_block,
                                                           mlp_grad_shapes)

    def run(case, inputs, out):
        from kernel_parity.kernels.cpu import blocks_bwd as k

        if op == MLP_BWD:
            names = mlp_grad_shapes(case.p)
            args, kw = _mlp_args(case, inputs)
            return k.mlp_backward(*args, inputs["dout"], **kw, **{n: inputs[n] for n in SAVED_MLP},
                                  weight_grads=f32_block(case.p, "w1", "w2"), out=_numpy_results(out, tuple(names)))
        names = attention_grad_shapes(case.p)
        args, kw = _attention_args(case, inputs)
        return k.attention_prefill_backward(*args, inputs["dout"], **kw, **{n: inputs[n] for n in SAVED_ATTENTION},
                                            weight_grads=f32_block(case.p, *ATTENTION_WEIGHTS),
                                            out=_numpy_results(out, tuple(names)))

    return run


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

    def backward(op: str):
        from kernel_parity.conformance.ops.blocks_grad import (ATTENTION_WEIGHTS, attention_grad_shapes, f32_block,
                                                               mlp_grad_shapes)

        def run(case, inputs, out):
            from kernel_parity.kernels.triton import blocks_bwd as k

            t = {name: to_torch(v, device) for name, v in inputs.items()}
            if op == MLP_BWD:
                names = mlp_grad_shapes(case.p)
                args, kw = _mlp_args(case, t)
                return k.mlp_backward(*args, t["dout"], **kw, **{n: t[n] for n in SAVED_MLP},
                                      weight_grads=f32_block(case.p, "w1", "w2"),
                                      out={n: out.torch(n, device) for n in names})
            names = attention_grad_shapes(case.p)
            args, kw = _attention_args(case, t)
            return k.attention_prefill_backward(*args, t["dout"], **kw, **{n: t[n] for n in (*SAVED_ATTENTION, "lse")},
                                                weight_grads=f32_block(case.p, *ATTENTION_WEIGHTS),
                                                out={n: out.torch(n, device) for n in names})

        return run

    def layer_backward(case, inputs, out):
        from kernel_parity.conformance.ops.blocks_grad import layer_grad_shapes
        from kernel_parity.kernels.triton import blocks_bwd as k

        t = {name: to_torch(v, device) for name, v in inputs.items()}
        args, kw = _layer_args(case, t)
        kw.update({n: v for n, v in _layer_backward_kw(case, t).items() if n != "scores"}, lse=t["lse"])
        return k.layer_backward(*args, t["dout"], **kw, out={n: out.torch(n, device) for n in layer_grad_shapes(case.p)})

    def layer(case, inputs, out):
        from kernel_parity.kernels.triton import blocks as k

        t = {name: to_torch(v, device) for name, v in inputs.items()}
        args, kw = _layer_args(case, t)
        res = k.layer(*args, **kw, out={name: out.torch(name, device) for name in LAYER_STAGES})
        return {**res, "k_cache": t["k_cache"], "v_cache": t["v_cache"]}

    mlp_names = ("norm", "h", "act", "down", "out")
    return {DECODE: attention("attention_decode"), PREFILL: attention("attention_prefill"),
            MLP: rows("mlp", _mlp_args, mlp_names),
            OUTPROJ_MLP: rows("outproj_mlp", _outproj_mlp_args, ("proj", "h1") + mlp_names), LAYER: layer,
            MLP_BWD: backward(MLP_BWD), PREFILL_BWD: backward(PREFILL_BWD), LAYER_BWD: layer_backward}


# The Triton backward kernels the composition of each block's backward takes beyond gemm_bwd.py's projections
# (kernels/triton/blocks_bwd.py): (module, function), looked up when a case asks.
TRITON_BACKWARD_STAGES = {
    MLP_BWD: (("norm_backward", "rms_norm_backward"), ("mlp", "glu_backward_fused")),
    PREFILL_BWD: (("norm_backward", "rms_norm_backward"), ("rope", "rope_backward"),
                  ("attention_bwd", "prefill_backward")),
}
TRITON_BACKWARD_STAGES[LAYER_BWD] = TRITON_BACKWARD_STAGES[PREFILL_BWD] + TRITON_BACKWARD_STAGES[MLP_BWD][1:]


def _triton_backward_missing(op: str) -> str | None:
    """The family Triton backward kernels the composition of `op` lacks, as a skip reason (None: all there)."""
    import importlib

    missing = []
    for module, fn in TRITON_BACKWARD_STAGES[op]:
        try:
            found = hasattr(importlib.import_module(f"kernel_parity.kernels.triton.{module}"), fn)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{fn}")
    if missing:
        return f"the Triton composition of {op} needs the Triton backward kernels {', '.join(missing)}"
    return None


def triton_claims() -> dict[str, Any]:
    return {op: "dequant" for op in OPS}


def triton_supports() -> dict[str, Callable]:
    def check(case) -> str | None:
        fmts = [case.p[k] for k in ("wqkv", "wk", "wv", "wo", "w1", "w2") if case.p.get(k)]
        bad = sorted({f for f in fmts if f not in TRITON_FORMATS})
        if bad:
            return (f"the Triton blocks take {', '.join(TRITON_FORMATS)} weights (the Triton GEMMs' GGML formats "
                    f"and fp32), not {', '.join(bad)}")
        return None

    def check_backward(case) -> str | None:
        return check(case) or _triton_backward_missing(case.op)

    def check_layer(case) -> str | None:
        if case.p.get("scores", 0):
            return ("scores=1: the Triton attention (attention_chunked.chunked_prefill) is an online softmax that "
                    "never materialises P, so the Triton layer has no saved scores to give")
        return check(case)

    def check_layer_backward(case) -> str | None:
        if case.p.get("scores", 0):
            return ("scores=1: the Triton attention backward (attention_bwd.prefill_backward) recomputes P from the "
                    "saved LSE and takes no saved scores")
        return check_backward(case)

    return {**{op: check for op in OPS}, LAYER: check_layer, MLP_BWD: check_backward, PREFILL_BWD: check_backward,
            LAYER_BWD: check_layer_backward}
