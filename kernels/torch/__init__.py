"""Eager PyTorch in the test dtype: the same-precision noise baseline (FlashAttention's method).

These are what a careful PyTorch user writes without a fused kernel: each elementwise op and
reduction runs in the tensor's own dtype, so their error is the yardstick a fast kernel is held
to ("no worse than k times the same-precision eager error").
"""
