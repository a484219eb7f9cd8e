"""Gluon kernels (`triton.experimental.gluon`): our compute-bound kernels written below Triton's
high-level language, with the warp specialisation it cannot express (a producer warp issuing bulk
tensor copies into a ring of shared-memory stages, consumer warp groups on the tensor cores, the
two synchronised through mbarriers). Hopper (sm_90) only; the backend `gluon`
(conformance/backends/gluon_backend.py) says why it cannot run anywhere else.

Written against Triton 3.6 (the GPU machine's); where Gluon's API moved between releases the
kernels take the difference as a constexpr (compat.py), pinned by tests/test_gluon_api.py on the GPU.
Import a module here only on a machine where `available()` is None: Gluon has no interpreter.
"""
