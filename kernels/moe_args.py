"""The argument rules of `route` that every MoE routing kernel shares (kernels/{triton,cpu,torch}/moe.py), one
place for the conditions and their messages. The golden (refimpl/moe.py) states the same rules on its own:
kernels know nothing of refimpl/."""

from __future__ import annotations

SCORINGS = ("softmax", "sigmoid")
MASKS = ("-inf", "zero")


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
