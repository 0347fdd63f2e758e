"""``TrafficMeter``: the bytes this rank sends and receives through ``torch.distributed``, counted
at the calls themselves.

A model of what context parallelism moves (:mod:`multihead.distributed.cost`) is only as good as
its agreement with what the code sends; this counts the payload of every point-to-point message
and collective the package issues, while active::

    with TrafficMeter() as meter:
        out = ring_attention(q, k, v, mask=mh.causal())
        forward = meter.snapshot()
        out.backward(grad)
    meter.sent, meter.received      # bytes, forward and backward
    meter.by_op                     # {"isend": bytes, "all_to_all_single": bytes, ...} sent
    meter.control                   # all_gather_object calls (the agreement checks: not payload)

It replaces the functions of ``torch.distributed`` that the package calls (``isend``, ``irecv``,
``send``, ``recv``, ``all_to_all_single``, ``all_gather``, ``broadcast``, ``all_gather_object``)
with counting wrappers for as long as it is active, in this process, whatever thread calls them
(one meter at a time). What is counted is what leaves for, or arrives from, another rank: an
all-to-all's own chunk stays here, an all-gather sends its tensor to ``P - 1`` ranks, a broadcast's
source sends to ``P - 1`` ranks (the payload, whatever tree or ring the backend runs underneath;
``docs/distributed.md`` compares it with the formulas).
"""

from __future__ import annotations

import pickle

import torch.distributed as dist
from torch import Tensor

__all__ = ["TrafficMeter"]

_WRAPPED = ("isend", "irecv", "send", "recv", "all_to_all_single", "all_gather", "broadcast", "all_gather_object")


class TrafficMeter:
    """Bytes sent and received by this rank while active (module docstring).

    Attributes:
        sent, received: payload bytes to and from other ranks.
        by_op: ``{function name: bytes sent}``.
        messages: point-to-point messages sent (``isend``/``send``).
        control: ``all_gather_object`` calls, and ``control_bytes`` their pickled objects sent.
    """

    _active: TrafficMeter | None = None

    def __init__(self) -> None:
        self.sent = self.received = self.messages = self.control = self.control_bytes = 0
        self.by_op: dict[str, int] = {}
        self._originals: dict = {}

    def snapshot(self) -> dict[str, int]:
        """The counts so far, to subtract from later ones (``forward`` = a snapshot after it)."""
        return {"sent": self.sent, "received": self.received, "messages": self.messages, "control": self.control}

    def __enter__(self) -> TrafficMeter:
        if TrafficMeter._active is not None:
            raise RuntimeError("TrafficMeter: a meter is already active in this process; expected one at a time")
        TrafficMeter._active = self
        self._originals = {name: getattr(dist, name) for name in _WRAPPED}
        for name in _WRAPPED:
            setattr(dist, name, self._wrap(name, self._originals[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        TrafficMeter._active = None

    def _count(self, op: str, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received
        self.by_op[op] = self.by_op.get(op, 0) + sent

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            getattr(self, "_" + name)(*args, **kwargs)
            return fn(*args, **kwargs)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    # --- what each call moves (the arguments as torch.distributed names them) ---
    def _isend(self, tensor: Tensor, *args, **kwargs) -> None:
        self.messages += 1
        self._count("isend", _nbytes(tensor), 0)

    _send = _isend

    def _irecv(self, tensor: Tensor, *args, **kwargs) -> None:
        self._count("irecv", 0, _nbytes(tensor))

    _recv = _irecv

    def _all_to_all_single(
        self, output: Tensor, input: Tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs
    ) -> None:
        P, me = dist.get_world_size(group), dist.get_rank(group)
        self._count(
            "all_to_all_single",
            _nbytes(input) - _own_chunk(input, input_split_sizes, P, me),
            _nbytes(output) - _own_chunk(output, output_split_sizes, P, me),
        )

    def _all_gather(self, tensor_list, tensor: Tensor, group=None, **kwargs) -> None:
        P = dist.get_world_size(group)
        self._count("all_gather", (P - 1) * _nbytes(tensor), sum(_nbytes(t) for t in tensor_list) - _nbytes(tensor))

    def _broadcast(self, tensor: Tensor, src=None, group=None, **kwargs) -> None:
        P = dist.get_world_size(group)
        if src is None:
            src = kwargs.get("group_src", 0)
        source = src if group is None or "group_src" in kwargs else dist.get_group_rank(group, src)
        if dist.get_rank(group) == source:
            self._count("broadcast", (P - 1) * _nbytes(tensor), 0)
        else:
            self._count("broadcast", 0, _nbytes(tensor))

    def _all_gather_object(self, object_list, obj, group=None) -> None:
        self.control += 1
        self.control_bytes += (dist.get_world_size(group) - 1) * len(pickle.dumps(obj))


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _own_chunk(t: Tensor, splits, P: int, me: int) -> int:
    """Bytes of the chunk an all-to-all keeps on this rank (rows ``splits[me]`` of dim 0, or ``1/P``)."""
    if not splits:
        return _nbytes(t) // P
    return splits[me] * (_nbytes(t) // max(1, t.shape[0]))
