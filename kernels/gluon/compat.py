"""What of Gluon's API the kernels rely on, and the one place its releases differ for them.

Two of them:
- `gl.warp_specialize` took (default_args, default_partition, worker_args, worker_partitions,
worker_num_warps, worker_num_regs) up to Triton 3.6 and takes ([(partition, args), ...],
  worker_num_warps, worker_num_regs) after; the kernels branch on WS_LIST, a constexpr;
- the bulk tensor copies are `tma.async_load` / `tma.async_store` in newer releases (3.9 raises on the
  old names) and `tma.async_copy_global_to_shared` / `async_copy_shared_to_global` in older ones (3.6):
  tma_ops() returns the pair, bound to module globals of the kernels (a kernel's source may not even name
  the other pair: Triton resolves every attribute in a kernel's source when it computes its cache key).
"""

from __future__ import annotations

import inspect
from functools import lru_cache

# (module, names) the gluon kernels import: checked by available() and tests/test_gluon_api.py
REQUIRED = {
    "triton.experimental.gluon": ("jit", "constexpr_function"),
    "triton.experimental.gluon.language": (
        "allocate_shared_memory", "arange", "load", "store", "zeros", "zeros_like", "program_id", "num_programs",
        "minimum", "maximum", "static_range", "warp_specialize", "NVMMADistributedLayout", "NVMMASharedLayout",
        "SliceLayout", "BlockedLayout", "exp2", "where", "float8e4nv", "bfloat16", "float16", "float32", "int64",
        "constexpr", "cdiv", "max", "sum", "split", "convert_layout", "inline_asm_elementwise", "atomic_add"),
    "triton.experimental.gluon.language.nvidia.hopper": (
        "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared"),
    "triton.experimental.gluon.language.nvidia.hopper.tma": ("store_wait",),
    "triton.experimental.gluon.language.nvidia.hopper.mbarrier": (
        "MBarrierLayout", "init", "invalidate", "expect", "wait", "arrive"),
    "triton.experimental.gluon.nvidia.hopper": ("TensorDescriptor",),
}


@lru_cache(maxsize=None)
def missing() -> tuple[str, ...]:
    """The names of REQUIRED this Triton lacks ('module.name'), or ('triton.experimental.gluon',)."""
    import importlib

    out = []
    for mod, names in REQUIRED.items():
        try:
            m = importlib.import_module(mod)
        except Exception:  # noqa: BLE001  (an ImportError, or a Triton that fails on import)
            out.append(mod)
            continue
        out.extend(f"{mod}.{n}" for n in names if not hasattr(m, n))
    if not out:
        from triton.experimental.gluon.language.nvidia.hopper import tma

        if not all(hasattr(tma, n) for n in (_TMA_NEW if tma_new() else _TMA_OLD)):
            out.append("triton.experimental.gluon.language.nvidia.hopper.tma." + "/".join(_TMA_OLD))
    return tuple(out)


_TMA_NEW = ("async_load", "async_store")
_TMA_OLD = ("async_copy_global_to_shared", "async_copy_shared_to_global")


def tma_ops():
    """(load, store): this Triton's bulk tensor copy global -> shared and shared -> global."""
    from triton.experimental.gluon.language.nvidia.hopper import tma

    return (tma.async_load, tma.async_store) if tma_new() else \
        (tma.async_copy_global_to_shared, tma.async_copy_shared_to_global)


def barrier_op():
    """This Triton's barrier of the threads of a CTA (inside a warp-specialised partition: of the partition):
    gl.thread_barrier (3.6), gl.barrier (3.9)."""
    from triton.experimental.gluon import language as gl

    return getattr(gl, "thread_barrier", None) or gl.barrier


@lru_cache(maxsize=None)
def tma_new() -> bool:
    """True where the bulk tensor copies are tma.async_load / async_store."""
    from triton.experimental.gluon.language.nvidia.hopper import tma

    return all(hasattr(tma, n) for n in _TMA_NEW)


@lru_cache(maxsize=None)
def ws_list() -> bool:
    """True where gl.warp_specialize takes the list of (partition, args) (Triton after 3.6)."""
    from triton.experimental.gluon import language as gl

    params = list(inspect.signature(gl.warp_specialize).parameters)
    if params[:1] == ["functions_and_args"]:
        return True
    if params[:2] == ["default_args", "default_partition"]:
        return False
    raise RuntimeError(f"gl.warp_specialize{inspect.signature(gl.warp_specialize)}: a signature the gluon kernels "
                       f"do not know")
