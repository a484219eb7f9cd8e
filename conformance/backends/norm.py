"""Adapters binding the normalisation kernels (RMSNorm, LayerNorm) of each built-in backend to op names.

Every kernel gets the aligned rows as they are (rows, n + pad) with the real width n, and writes
into the poisoned output buffers: the padding lanes it leaves unwritten or non-zero fail the
structure layer. rstd (and mean) are requested only when the case asks for them.
"""

from __future__ import annotations

from typing import Any

from kernel_parity.conformance.backends._torch import to_torch


def _eps(case: Any) -> float:
    return float(case.p["eps"])  # a string in case ids ("1e-6")


def triton_ops(device: str) -> dict[str, Any]:
    def rms_norm(case, inputs, out):
        from kernel_parity.kernels.triton import norm as k

        p = case.p
        res = {"y": out.torch("y", device)}
        if p["residual"]:
            res["h"] = out.torch("h", device)
        if p["rstd"]:
            res["rstd"] = out.torch("rstd", device)
        k.rms_norm(to_torch(inputs["x"], device), to_torch(inputs["w"], device), _eps(case), n=p["n"],
                   gemma=bool(p["gemma"]), residual=to_torch(inputs["r"], device) if p["residual"] else None,
                   out=res["y"], out_h=res.get("h"), out_rstd=res.get("rstd"))
        return res

    def layer_norm(case, inputs, out):
        from kernel_parity.kernels.triton import norm as k

        p = case.p
        res = {"y": out.torch("y", device)}
        if p["stats"]:
            res["mean"], res["rstd"] = out.torch("mean", device), out.torch("rstd", device)
        k.layer_norm(to_torch(inputs["x"], device), to_torch(inputs["w"], device),
                     to_torch(inputs["b"], device) if p["bias"] else None, _eps(case), n=p["n"],
                     out=res["y"], out_mean=res.get("mean"), out_rstd=res.get("rstd"))
        return res

    return {"norm.rms_norm": rms_norm, "norm.layer_norm": layer_norm, **_triton_backward(device)}


def cpu_ops() -> dict[str, Any]:
    def rms_norm(case, inputs, out):
        from kernel_parity.kernels.cpu import norm as k

        p = case.p
        res = {"y": out.numpy("y")}
        if p["residual"]:
            res["h"] = out.numpy("h")
        if p["rstd"]:
            res["rstd"] = out.numpy("rstd")
        k.rms_norm(inputs["x"], inputs["w"], _eps(case), n=p["n"], gemma=bool(p["gemma"]),
                   residual=inputs["r"] if p["residual"] else None,
                   out=res["y"], out_h=res.get("h"), out_rstd=res.get("rstd"))
        return res

    def layer_norm(case, inputs, out):
        from kernel_parity.kernels.cpu import norm as k

        p = case.p
        res = {"y": out.numpy("y")}
        if p["stats"]:
            res["mean"], res["rstd"] = out.numpy("mean"), out.numpy("rstd")
        k.layer_norm(inputs["x"], inputs["w"], inputs["b"] if p["bias"] else None, _eps(case), n=p["n"],
                     out=res["y"], out_mean=res.get("mean"), out_rstd=res.get("rstd"))
        return res

    return {"norm.rms_norm": rms_norm, "norm.layer_norm": layer_norm, **_cpu_backward()}


def torch_ops(device: str) -> dict[str, Any]:
    def rms_norm(case, inputs, out):
        from kernel_parity.kernels.torch import norm as k

        p = case.p
        y = out.torch("y", device)
        r = to_torch(inputs["r"], device) if p["residual"] else None
        _, h, rstd = k.rms_norm(to_torch(inputs["x"], device), to_torch(inputs["w"], device), _eps(case),
                                n=p["n"], gemma=bool(p["gemma"]), residual=r, out=y)
        res = {"y": y}
        if p["residual"]:
            res["h"] = out.torch("h", device).copy_(h)
        if p["rstd"]:
            res["rstd"] = out.torch("rstd", device).copy_(rstd)
        return res

    def layer_norm(case, inputs, out):
        from kernel_parity.kernels.torch import norm as k

        p = case.p
        y = out.torch("y", device)
        b = to_torch(inputs["b"], device) if p["bias"] else None
        _, mean, rstd = k.layer_norm(to_torch(inputs["x"], device), to_torch(inputs["w"], device), b, _eps(case),
                                     n=p["n"], out=y)
        res = {"y": y}
        if p["stats"]:
            res["mean"] = out.torch("mean", device).copy_(mean)
            res["rstd"] = out.torch("rstd", device).copy_(rstd)
        return res

    def rms_norm_backward(case, inputs, out):
        from kernel_parity.kernels.torch import norm as k

        p = case.p
        t = {name: to_torch(a, device) for name, a in inputs.items()}
        dx, dw = k.rms_norm_backward(t["x"], t["w"], t["dy"], _eps(case), n=p["n"], gemma=bool(p["gemma"]),
                                     residual=t.get("r"), dh=t.get("dh"), out=out.torch("dx", device))
        return {"dx": dx, "dw": out.torch("dw", device).copy_(dw)}

    def layer_norm_backward(case, inputs, out):
        from kernel_parity.kernels.torch import norm as k

        p = case.p
        t = {name: to_torch(a, device) for name, a in inputs.items()}
        dx, dw, db = k.layer_norm_backward(t["x"], t["w"], t.get("b"), t["dy"], _eps(case), n=p["n"],
                                           out=out.torch("dx", device))
        res = {"dx": dx, "dw": out.torch("dw", device).copy_(dw)}
        if p["bias"]:
            res["db"] = out.torch("db", device).copy_(db)
        return res

    return {"norm.rms_norm": rms_norm, "norm.layer_norm": layer_norm,
            "norm.rms_norm_backward": rms_norm_backward, "norm.layer_norm_backward": layer_norm_backward}


# -- backward ---------------------------------------------------------------------------------------
def _triton_backward(device: str) -> dict[str, Any]:
    def rms_norm_backward(case, inputs, out):
        from kernel_parity.kernels.triton import norm_backward as k

        p = case.p
        t = {name: to_torch(a, device) for name, a in inputs.items()}
        dx, dw = out.torch("dx", device), out.torch("dw", device)
        k.rms_norm_backward(t["x"], t["w"], t["rstd"], t["dy"], n=p["n"], gemma=bool(p["gemma"]),
                            residual=t.get("r"), dh=t.get("dh"), out_dx=dx, out_dw=dw)
        return {"dx": dx, "dw": dw}

    def layer_norm_backward(case, inputs, out):
        from kernel_parity.kernels.triton import norm_backward as k

        p = case.p
        t = {name: to_torch(a, device) for name, a in inputs.items()}
        res = {"dx": out.torch("dx", device), "dw": out.torch("dw", device)}
        if p["bias"]:
            res["db"] = out.torch("db", device)
        k.layer_norm_backward(t["x"], t["w"], t["mean"], t["rstd"], t["dy"], n=p["n"], out_dx=res["dx"],
                              out_dw=res["dw"], out_db=res.get("db"))
        return res

    return {"norm.rms_norm_backward": rms_norm_backward, "norm.layer_norm_backward": layer_norm_backward}


def _cpu_backward() -> dict[str, Any]:
    def rms_norm_backward(case, inputs, out):
        from kernel_parity.kernels.cpu import norm_backward as k

        p = case.p
        dx, dw = out.numpy("dx"), out.numpy("dw")
        k.rms_norm_backward(inputs["x"], inputs["w"], inputs["rstd"], inputs["dy"], n=p["n"],
                            gemma=bool(p["gemma"]), residual=inputs.get("r"), dh=inputs.get("dh"), out_dx=dx,
                            out_dw=dw)
        return {"dx": dx, "dw": dw}

    def layer_norm_backward(case, inputs, out):
        from kernel_parity.kernels.cpu import norm_backward as k

        p = case.p
        res = {"dx": out.numpy("dx"), "dw": out.numpy("dw")}
        if p["bias"]:
            res["db"] = out.numpy("db")
        k.layer_norm_backward(inputs["x"], inputs["w"], inputs["mean"], inputs["rstd"], inputs["dy"], n=p["n"],
                              out_dx=res["dx"], out_dw=res["dw"], out_db=res.get("db"))
        return res

    return {"norm.rms_norm_backward": rms_norm_backward, "norm.layer_norm_backward": layer_norm_backward}
