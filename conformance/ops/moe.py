"""The `moe` family (issue 34): mixture-of-experts layers. Each op's spec is in its own module:

- moe.route (conformance/ops/moe_route.py): top-k expert routing (Mixtral, Qwen3, DeepSeek-V3);
- moe.align (moe_align.py): vLLM's moe_align_block_size, the token slots sorted into expert blocks;
- moe.experts (moe_experts.py): the fused experts layer (SwiGLU experts over routed tokens, shared experts);
- moe.route_backward (moe_grad.py): the routing weights' gradient with respect to the logits;
- moe.experts_backward (moe_experts_grad.py): the experts layer's gradients (x, the routing weights, w13, w2);
- moe.layer (moe_layer.py): the MoE layer end to end (router GEMM, routing, alignment, experts, shared experts).
The modules import nothing of this one (moe_route.py holds the routing helpers the others share).
"""

from __future__ import annotations

from kernel_parity.conformance.ops import moe_align, moe_experts, moe_experts_grad, moe_grad, moe_layer, moe_route
from kernel_parity.conformance.ops.moe_route import DISTS, ROUTE, canonical, route_args  # noqa: F401  (re-exported)

SPECS = moe_route.SPECS + moe_align.SPECS + moe_experts.SPECS + moe_grad.SPECS + moe_experts_grad.SPECS + moe_layer.SPECS
