"""The argument rules the MoE kernels share, one place for the conditions and their messages: `route`'s
(kernels/{triton,cpu,torch}/moe.py, moe_grad.py, moe_layer.py) and `align`'s (moe.align,
kernels/{triton,cpu,torch}/moe_align.py). The goldens (refimpl/moe.py, refimpl/moe_align.py) state the same rules
on their own: kernels know nothing of refimpl/."""

from __future__ import annotations

SCORINGS = ("softmax", "sigmoid")
MASKS = ("-inf", "zero")
INT32_MAX = 2**31 - 1


def check_route_args(E: int, k, scoring, n_group, topk_group, mask) -> None:
    """ValueError (one line naming the argument and what was expected) unless the routing of E experts is valid."""
    if scoring not in SCORINGS:
        raise ValueError(f"moe.route: scoring={scoring!r} must be one of {', '.join(SCORINGS)}")
    if mask not in MASKS:
        raise ValueError(f"moe.route: mask={mask!r} must be one of {', '.join(MASKS)}")
    if not (isinstance(n_group, int) and n_group >= 1 and E % n_group == 0):
        raise ValueError(f"moe.route: n_group={n_group!r} must be a positive divisor of E={E}")
    if not (isinstance(topk_group, int) and 1 <= topk_group <= n_group):
        raise ValueError(f"moe.route: topk_group={topk_group!r} must be in [1, n_group={n_group}]")
    if not (isinstance(k, int) and 1 <= k <= topk_group * (E // n_group)):
        raise ValueError(f"moe.route: k={k!r} must be in [1, {topk_group * (E // n_group)}] (the experts of the "
                         f"{topk_group} kept groups of {E // n_group})")


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
