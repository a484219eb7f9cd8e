"""The `kvquant` family (issue 34): attention over quantized KV caches (FP8 e4m3 / e5m2, int8; per-tensor,
per-head and per-token scales), refimpl/kvquant.py's formats. Each op's spec is in its own module:

- kvquant.update (conformance/ops/kvquant_update.py): the write path, quantize on append into a paged cache;
- kvquant.decode_paged (conformance/ops/kvquant_decode.py): the read path, paged decode attention that
  dequantizes inside;
- kvquant.mla_sparse (conformance/ops/kvquant_mla.py): FlashMLA's sparse MLA decode over its FP8 cache rows of
  656 bytes;
- kvquant.chunked_prefill (conformance/ops/kvquant_prefill.py): packed query chunks over a quantized paged cache
  holding each sequence's history;
- kvquant.append_decode (conformance/ops/kvquant_append.py): the write and read paths fused, the new token
  quantized into the cache and attended over in one kernel;
- kvquant.decode, kvquant.decode_split (conformance/ops/kvquant_split.py): decode over a contiguous quantized cache
  (s_q >= 1), and flash decoding's per-split partials and merge over a contiguous or paged one;
- kvquant.mla_decode, kvquant.mla_pack (conformance/ops/kvquant_mla_dense.py): FlashMLA's dense paged MLA decode
  over the 656-byte FP8 rows, and the write path of those rows.
"""

from __future__ import annotations

from kernel_parity.conformance.ops import (kvquant_append, kvquant_decode, kvquant_mla, kvquant_mla_dense, kvquant_prefill,
                                           kvquant_split, kvquant_update)

SPECS = (kvquant_update.SPECS + kvquant_decode.SPECS + kvquant_mla.SPECS + kvquant_prefill.SPECS + kvquant_append.SPECS
         + kvquant_split.SPECS + kvquant_mla_dense.SPECS)
