"""Triton kernels. Import a module (kernels.triton.softmax) only after deciding whether
TRITON_INTERPRET=1 applies: triton.jit reads it when the module is first imported."""
