"""The LSE conventions of an empty row, and the one conversion adapters apply (seed audit S22).

A row with no visible key (every logit masked, or a request of length 0) has no probability mass:
its softmax sum is 0 and its log-sum-exp ln 0.

- The project (OPS.md, refimpl/attention.py, refimpl/mla.py, refimpl/combine.py): LSE = -inf, O = 0.
  -inf is ln 0 itself, and lse_combine's weights exp(LSE_i - LSE) are then 0 for an empty split
  without a special case (`-inf - -inf` is never evaluated).
- FlashMLA (`flash_mla_with_kvcache`) and FlashAttention-2 / flash-attn-4 (`return_lse`): LSE = +inf,
  O = 0 (their kernels write `INFINITY` for a row whose sum is 0, so that a later 1 / l or exp(-lse)
  stays finite in their own combine). Their split partials use -inf, like ours.

An adapter of such a library converts with `empty_row_lse_to_neg_inf` before handing the LSE to the
judge; nothing else about an LSE changes (a NaN stays NaN: a kernel's NaN is never masked, and a
finite value is passed through bit for bit). A base-2 LSE (FlashInfer, FlashMLA's split partials) is a
separate conversion (multiply by ln 2), not this one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

PROJECT_EMPTY_ROW_LSE = -math.inf  # ln 0: OPS.md's LSE of a row with no key
FLASH_EMPTY_ROW_LSE = math.inf  # FlashMLA's and FlashAttention's LSE of a row with no key


def empty_row_lse_to_neg_inf(lse: Any) -> Any:
    """FlashMLA / FlashAttention's empty-row LSE (+inf) as the project's (-inf); every other value as given.

    lse: an LSE array of any shape, NumPy (or a scalar) or torch (anything with `masked_fill`)
    returns: a new array of the same type, shape and dtype, +inf -> -inf; NaN, -inf and finite values
    unchanged (a NaN is a kernel's bug, not an empty row: it is never masked)
    """
    if hasattr(lse, "masked_fill"):  # torch: no import here, and the tensor stays on its device
        return lse.masked_fill(lse == FLASH_EMPTY_ROW_LSE, PROJECT_EMPTY_ROW_LSE)
    a = np.asarray(lse)
    return np.where(a == FLASH_EMPTY_ROW_LSE, np.asarray(PROJECT_EMPTY_ROW_LSE, dtype=a.dtype), a)
