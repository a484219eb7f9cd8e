"""Production kernels: Triton (GPU, or CPU through the interpreter), native C, eager torch.

Kernels know nothing of refimpl/ or conformance/: they take tensors/arrays and return them.
"""
