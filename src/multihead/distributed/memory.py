"""``TensorMemory``: the peak bytes of tensors a piece of code creates, on any device.

A rank's activation memory is what its share of the work allocates. On GPUs
``torch.cuda.max_memory_allocated`` answers; on CPUs torch keeps no such count, and the process's
resident size (``ru_maxrss``) mixes it with the allocator's caching, gloo's buffers and the
interpreter, which at moderate sizes outweigh the attention itself. This counts tensors instead::

    with TensorMemory() as memory:
        out = ring_attention(q, k, v, mask=mh.causal())
        forward = memory.peak
        out.backward(grad)
    memory.peak          # bytes: the most that was alive at once, forward and backward
    memory.at_peak(5)    # the five largest of them: (bytes, op, shape)

It is a ``TorchDispatchMode``: every storage that an ATen op returns is counted from the op that
creates it until it is freed (a ``weakref`` on the storage). Views and in-place results share a
storage and are not counted again; tensors that existed before entering are not counted at all
(the inputs); scratch that a kernel allocates and frees inside itself is not seen, and neither is
memory that a communication library holds outside tensors.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TensorMemory"]


class TensorMemory(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while the mode is active (module docstring).

    Attributes:
        live: bytes alive now, of the storages created under the mode.
        peak: the most bytes alive at once since entering (or :meth:`reset_peak`).
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, tuple[int, str, tuple[int, ...]]] = {}  # data_ptr -> (bytes, op, shape)
        self._at_peak: list = []

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self.live
        self._at_peak = list(self._sizes.values())

    def at_peak(self, n: int = 10) -> list[tuple[int, str, tuple[int, ...]]]:
        """The ``n`` largest storages alive at the peak: ``(bytes, op that created it, shape)``."""
        return sorted(self._at_peak, key=lambda e: -e[0])[:n]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._sizes or storage.nbytes() == 0:
                continue  # a view, an in-place result, or nothing allocated
            self._sizes[key] = (storage.nbytes(), str(func.overloadpacket.__name__), tuple(t.shape))
            self.live += storage.nbytes()
            if self.live > self.peak:
                self.peak = self.live
                self._at_peak = list(self._sizes.values())
            weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key: int) -> None:
        entry = self._sizes.pop(key, None)
        if entry is not None:
            self.live -= entry[0]
