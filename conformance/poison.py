"""Poisoned output buffers with canaries.

Backends ask the request for their output buffers: each is a view into a larger buffer
whose every byte starts as a poison pattern (a NaN with payload 0xAA.. for 16-bit and wider
floats; the byte 0xAA for 8- and 4-bit types and integers). CANARY elements before and after the
view, and any row padding, must still hold the poison after the kernel ran (an out-of-bounds write
fails structurally); elements of the output that still hold the exact poison bits were never
written.

For 8- and 4-bit types and integers every byte is a value a kernel may legitimately write (0xAA
is -0.3125 in fp8 e4m3), so an element equal to the poison is only *possibly* unwritten: the
runner then runs the kernel once more into buffers poisoned with the alternate pattern (0x55), and
an element that holds the poison in both runs was never written (`OutputRequest(alt=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernel_parity.conformance import dtypes as dt

CANARY = 64  # elements on each side of every output

# Bit patterns: NaNs whose payload reads 0xAA.. so they are recognisable in a hex dump.
POISON_BITS = {8: 0xAA, 16: 0x7EAA, 32: 0x7FAAAAAA, 64: 0x7FFAAAAAAAAAAAAA}
_POISON_BF16 = 0x7FAA
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def poison_bits(d: dt.DType, alt: bool = False) -> int:
    """The poison bit pattern of dtype d (alt: the second pattern of types with no spare NaN)."""
    if d.poison_is_nan:
        return _POISON_BF16 if d.name == "bf16" else POISON_BITS[d.storage_bits]
    return int.from_bytes((b"\x55" if alt else b"\xaa") * d.np.itemsize, "little")


def poison_array(n: int, d: dt.DType, alt: bool = False) -> np.ndarray:
    u = _UINT[d.np.itemsize]
    return np.full(n, poison_bits(d, alt), dtype=u).view(d.np)


def is_poison(a: np.ndarray, d: dt.DType, alt: bool = False) -> np.ndarray:
    u = _UINT[a.dtype.itemsize]
    return np.ascontiguousarray(a).view(u) == u(poison_bits(d, alt))


@dataclass
class _Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: dt.DType
    pad: int
    whole: Any  # the full buffer (numpy array or torch tensor), flat
    view: Any

    def layout(self) -> tuple[int, int]:
        """(rows, padded row length) of the region between the canaries."""
        n = self.shape[-1] if self.shape else 1
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        return rows, n + self.pad


@dataclass
class OutputRequest:
    """The outputs a case expects: name -> (shape, dtype). Backends allocate through it."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, dt.DType]
    pads: dict[str, int] = field(default_factory=dict)  # poisoned elements after each last-axis row
    buffers: dict[str, _Buffer] = field(default_factory=dict)
    backend: Any = None  # the backend being run, for adapters that need it (or its device)
    device: Any = "cpu"
    alt: bool = False  # poison with the alternate pattern (the second run for 8-bit and smaller types)

    def numpy(self, name: str) -> np.ndarray:
        """A poisoned numpy output buffer (view between canaries, rows padded by `pad`)."""
        shape, d = self._get(name)
        rows, row_len = self._rows(name, shape)
        whole = poison_array(2 * CANARY + rows * row_len, d, self.alt)
        view = _strided_view(whole, shape, row_len)
        self.buffers[name] = _Buffer(name, shape, d, row_len - (shape[-1] if shape else 1), whole, view)
        return view

    def torch(self, name: str, device: Any) -> Any:
        """A poisoned torch output buffer on `device` (same layout as `numpy`)."""
        import torch

        shape, d = self._get(name)
        rows, row_len = self._rows(name, shape)
        host = poison_array(2 * CANARY + rows * row_len, d, self.alt)
        t_int = torch.from_numpy(host.view(_SIGNED[d.np.itemsize]))  # torch lacks some uint views
        if d.torch_name is None:
            raise TypeError(f"torch has no dtype for {d.name}: use out.numpy({name!r}) for this output")
        whole = t_int.to(device).view(getattr(torch, d.torch_name))
        strides = _strides(shape, row_len)
        view = whole.as_strided(shape, strides, CANARY)
        self.buffers[name] = _Buffer(name, shape, d, row_len - (shape[-1] if shape else 1), whole, view)
        return view

    def damage(self) -> dict[str, str]:
        """Outputs whose canaries or padding were overwritten, with where."""
        found = {}
        for name, b in self.buffers.items():
            whole = _to_host(b.whole, b.dtype)
            rows, row_len = b.layout()
            ok = is_poison(whole, b.dtype, self.alt)
            region = np.zeros(whole.shape, dtype=bool)
            region[:CANARY] = True
            region[CANARY + rows * row_len:] = True
            if b.pad and b.shape:
                body = region[CANARY:CANARY + rows * row_len].reshape(rows, row_len)
                body[:, b.shape[-1]:] = True
            hit = region & ~ok
            if hit.any():
                first = int(np.flatnonzero(hit)[0])
                where = ("before the output" if first < CANARY else
                         "after the output" if first >= CANARY + rows * row_len else "in row padding")
                found[name] = f"{int(hit.sum())} canary/padding element(s) overwritten, first {where}"
        return found

    def _get(self, name: str) -> tuple[tuple[int, ...], dt.DType]:
        if name not in self.shapes:
            raise KeyError(f"no output named {name!r} (outputs: {', '.join(self.shapes)})")
        return tuple(self.shapes[name]), self.dtypes[name]

    def _rows(self, name: str, shape: tuple[int, ...]) -> tuple[int, int]:
        n = shape[-1] if shape else 1
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return rows, n + self.pads.get(name, 0)


def _strides(shape: tuple[int, ...], row_len: int) -> tuple[int, ...]:
    if not shape:
        return ()
    strides = [1]
    acc = row_len
    for s in reversed(shape[:-1]):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _strided_view(whole: np.ndarray, shape: tuple[int, ...], row_len: int) -> np.ndarray:
    item = whole.itemsize
    return np.ndarray(shape, whole.dtype, buffer=whole, offset=CANARY * item,
                      strides=tuple(s * item for s in _strides(shape, row_len)))


_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _to_host(x: Any, d: dt.DType) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return tensor_to_numpy(x, d)


def tensor_to_numpy(t: Any, d: dt.DType | None = None) -> np.ndarray:
    """Copy a torch tensor to host numpy, keeping every bit (bf16 included) and the strides' values."""
    import torch

    if d is None:
        d = dt.get(str(t.dtype).replace("torch.", ""))
    t = t.detach()
    if d.np.kind == "V":  # bf16, fp8: numpy has no such type, ml_dtypes does: move the bits
        ints = {1: torch.uint8, 2: torch.int16}[d.np.itemsize]
        return t.view(ints).cpu().numpy().view(d.np)
    return t.cpu().numpy()


class BenchRequest(OutputRequest):
    """An OutputRequest for timing: each output buffer is made (and poisoned) once, then handed back
    as it is on every later call, so repeated calls time the kernel and not the allocation."""

    def numpy(self, name: str) -> np.ndarray:
        if name not in self.buffers:
            super().numpy(name)
        return self.buffers[name].view

    def torch(self, name: str, device: Any) -> Any:
        if name not in self.buffers:
            super().torch(name, device)
        return self.buffers[name].view
