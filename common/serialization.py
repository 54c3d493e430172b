"""Tensor frames: how tensors and arrays cross a ZeroMQ socket without pickle or copies.

A message is a list of frames: ``[tag, header, buf_0, buf_1, ...]``. Inside the msgpack
header each tensor is a msgpack *extension* (code ``TENSOR_EXT``) holding
``(dtype, shape, frame index)``; its raw bytes travel as frame ``2 + index``, handed to ZMQ
as a buffer (zero-copy send), and on receipt are wrapped by ``torch.frombuffer`` (zero-copy
receive). Decoded tensors are views into the received frame: treat them as read-only, and
``.clone()`` before mutating in place.

Supported dtypes are the ones the roles exchange (``common.dtypes.DTYPES``); bf16 has no numpy
equivalent, so both numpy arrays and torch tensors decode to torch tensors. Non-contiguous
tensors are made contiguous on send (one copy, on the sender). Empty tensors carry an empty
frame.

torch is imported lazily, so that entry points can answer ``--help`` before paying for it.
"""

from __future__ import annotations

import warnings
from typing import Any

import msgspec

from common.dtypes import DTYPES, dtype_name

TENSOR_EXT = 1


_MAX_NDIM = 8
_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(tuple[str, list[int], int])


class WireError(ValueError):
    """A message that cannot be decoded: malformed, truncated, unknown type, oversized."""


def _torch():
    import torch

    return torch


def _as_torch(obj: Any):
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        return obj
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    raise TypeError(f"cannot send object of type {type(obj).__name__} over the wire")


class TensorEncoder:
    """Encodes a message struct to ``header`` bytes plus a list of out-of-band buffers."""

    def __init__(self) -> None:
        self._buffers: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def _enc_hook(self, obj: Any) -> Any:
        t = _as_torch(obj)
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        name = dtype_name(t.dtype)
        if name not in DTYPES:
            raise TypeError(f"dtype {t.dtype} is not supported on the wire (supported: {sorted(DTYPES)})")
        index = len(self._buffers)
        # A byte view over the tensor storage; the tensor object is kept alive by the list
        # until the frames are handed to ZMQ (which then holds its own reference).
        if t.numel() == 0:
            self._buffers.append(b"")
        else:
            self._buffers.append(t.reshape(-1).view(_torch().uint8).numpy().data)
        return msgspec.msgpack.Ext(TENSOR_EXT, _meta_encoder.encode((name, list(t.shape), index)))

    def encode(self, msg: Any) -> tuple[bytes, list[Any]]:
        self._buffers = []
        try:
            header = self._encoder.encode(msg)
            return header, self._buffers
        finally:
            self._buffers = []


def make_ext_hook(get_buffers):
    """Returns an ext hook that turns tensor extensions back into torch tensors.

    ``get_buffers()`` returns the buffer frames of the message being decoded (a callable, so
    one decoder per message type can be built once and reused).
    """

    def ext_hook(code: int, data: memoryview) -> Any:
        buffers = get_buffers()
        if code != TENSOR_EXT:
            raise WireError(f"unknown msgpack extension code {code}")
        try:
            name, shape, index = _meta_decoder.decode(data)
        except msgspec.DecodeError as e:
            raise WireError(f"bad tensor descriptor: {e}") from None
        if name not in DTYPES:
            raise WireError(f"unknown tensor dtype {name!r}")
        if len(shape) > _MAX_NDIM or any(d < 0 for d in shape):
            raise WireError(f"bad tensor shape {shape}")
        if not 0 <= index < len(buffers):
            raise WireError(f"tensor frame {index} missing (message has {len(buffers)} buffer frames)")
        torch = _torch()
        dtype = getattr(torch, DTYPES[name])
        buf = buffers[index]
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
        if nbytes != numel * itemsize:
            raise WireError(
                f"tensor frame {index} has {nbytes} bytes, descriptor {name}{shape} needs {numel * itemsize}"
            )
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            # ZMQ exposes received frames as read-only buffers; the memory is ours alone.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buf, dtype=dtype).view(shape)

    return ext_hook
