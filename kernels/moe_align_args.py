"""The argument rules of `align` (moe.align) that its kernels share (kernels/{triton,cpu,torch}/moe_align.py), one
place for the conditions and their messages. The golden (refimpl/moe_align.py) states the same rules on its own:
kernels know nothing of refimpl/."""

from __future__ import annotations

INT32_MAX = 2**31 - 1


def check_align_args(shape: tuple, dtype: str, num_experts, block_size) -> tuple[int, int, int, int]:
    """(T, k, E, B), or ValueError (one line naming the argument and what was expected).

    shape / dtype: topk_ids' shape and dtype name ("int32", "torch.int32", ... : the "torch." is dropped)."""
    dtype = str(dtype).replace("torch.", "")
    if len(shape) != 2 or dtype != "int32":
        raise ValueError(f"moe.align: topk_ids must be a (T, k) int32 array, got {dtype} shape {tuple(shape)}")
    if isinstance(num_experts, bool) or not hasattr(num_experts, "__index__") or num_experts < 1:
        raise ValueError(f"moe.align: num_experts={num_experts!r} must be an int >= 1")
    if isinstance(block_size, bool) or not hasattr(block_size, "__index__") or block_size < 1:
        raise ValueError(f"moe.align: block_size={block_size!r} must be an int >= 1")
    T, k = (int(n) for n in shape)
    E, B = int(num_experts), int(block_size)
    P = T * k + E * (B - 1)
    if P > INT32_MAX:
        raise ValueError(f"moe.align: T k + E (B - 1) = {P} entries do not fit int32 (at most {INT32_MAX})")
    return T, k, E, B


def bad_id(value: int, num_experts: int) -> ValueError:
    """The error for an expert id outside [0, E) (the first one in slot order)."""
    return ValueError(f"moe.align: expert id {int(value)} outside [0, num_experts={num_experts})")


def out_sizes(T: int, k: int, E: int, B: int) -> tuple[int, int]:
    """(P, ceil(P / B)): the lengths of sorted_ids and expert_ids."""
    P = T * k + E * (B - 1)
    return P, -(-P // B)
