"""Delta pushes: only the values that changed since the fleet's last push, checked by digests.

``--weight_sync delta`` (``WeightPublisher(sync="delta")``). Both ends keep the weights of the
last push in the served dtype: the learner a host copy (``EncodedWeights``), each server's
workers a copy on their device (``DeltaBase``, driven by ``rollout_service.worker_ext``). A push
is then one of two encodings (``WeightUpdate.encoding``):

- ``full``: every tensor whole, under its own name, which the server keeps as its base. Sent
  when any target lacks the learner's base (a joiner, a reconnect after a failed push, any
  server at a learner's first push).
- ``delta``: per tensor, the values whose *bits* differ from the base (the int view of the
  served dtype: a value that rounds to the same bf16 is not sent), as ``NAME#idx`` (int32, or
  int64 past 2**31 values: flat positions) and ``NAME#val`` (the new values); or ``NAME`` whole
  when that is fewer bytes (``encode``: sparse iff k * (index + value bytes) < n * value
  bytes, i.e. for bf16 and int32 indices iff fewer than a third of the values changed); a
  tensor with no change is not sent at all.

Either push ends with ``#digest``: an int64 per base tensor (``digest``) of the values the
learner now holds. Each server applies the push to its base, computes the same digest of every
tensor of it and compares; a mismatch fails the push (the server's base is dropped, it serves
nothing until a full push lands) with an error naming the tensors. Only then are the tensors
loaded into the model (every one of them: vLLM's layerwise reload re-creates each layer and needs
all its weights, so what a delta saves is bytes on the wire, not the load).

The wire carries these as ordinary tensors of the packed layout (``common.weights.wire``): the
backends, the fleet relay and the retry are the same for every encoding.

No vLLM import here: the learner uses ``EncodedWeights``, the workers ``DeltaBase``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from common.weights.wire import ParamMeta

log = logging.getLogger(__name__)

SYNCS = ("full", "delta")  # --weight_sync
IDX, VAL, DIGEST = "#idx", "#val", "#digest"
# The digest sums the tensor's bytes as int64 words in blocks of this many words (512 bytes):
# one pass at memory speed, no int64 copy of the values.
DIGEST_BLOCK_WORDS = 64
_BLOCK_BYTES = DIGEST_BLOCK_WORDS * 8

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened and reinterpreted as signed integers of its item size (bool, uint8 and
    int8 as uint8): comparing these compares the exact bits of the served values."""
    flat = t.contiguous().view(-1)
    if t.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INT_VIEW[t.element_size()])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    b = t.contiguous().view(-1).view(torch.uint8)
    return b if b.storage_offset() % 8 == 0 else b.clone()  # int64 words need 8-byte alignment


def digest(t: torch.Tensor) -> torch.Tensor:
    """An int64 of ``t``'s bits, computed where ``t`` is (no host sync). ``t``'s bytes (little
    endian, zero-padded to whole 512-byte blocks) are read as int64 words; block ``k`` (words
    ``64k .. 64k+63``) sums its words, and the digest is ``sum_k (k + 1) * blocksum_k``, all mod
    2**64 (wrapping integer sums are exact in any order, so a learner's GPU, a server's GPU and a
    CPU agree). One changed value always changes it (its bits move one word by ``d * 2**shift``
    with ``0 < |d| < 2**(8 * itemsize)``, never 0 mod 2**64); values swapped between blocks or
    between positions within a word change it too. Example: bf16 ``[1.0, -2.0]`` is the bytes
    ``80 3F 00 C0``, one word ``0xC0003F80`` = 3221241728, in block 0: the digest is 3221241728."""
    b = _bytes(t)
    full = b.numel() // _BLOCK_BYTES
    sums = b[: full * _BLOCK_BYTES].view(torch.int64).view(full, DIGEST_BLOCK_WORDS).sum(1)
    if b.numel() > full * _BLOCK_BYTES:  # the last, partial block, zero-padded
        last = torch.zeros(_BLOCK_BYTES, dtype=torch.uint8, device=b.device)
        last[: b.numel() - full * _BLOCK_BYTES] = b[full * _BLOCK_BYTES :]
        sums = torch.cat([sums, last.view(torch.int64).sum().view(1)])
    return (sums * torch.arange(1, sums.numel() + 1, device=b.device)).sum()


def digest_change(idx: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """How ``digest`` moves when the values at flat positions ``idx`` go from ``old`` to ``new``
    (1-D, one dtype): ``sum_i (u(new_i) - u(old_i)) * 2**(8 * (p_i mod 8)) * (p_i // 512 + 1)``
    mod 2**64, with ``p_i = idx_i * itemsize`` the value's byte offset and ``u`` its bits as an
    unsigned integer. O(k) for k changed values: the learner's digest of a delta push without
    reading the unchanged values again. Example: bf16 0.0 -> 1.0 at position 1: u goes 0 ->
    0x3F80 = 16256, byte 2 of word 0, block 0: ``16256 * 2**16 = 1065353216``."""
    size = new.element_size()
    p = idx.to(torch.int64) * size
    if size == 8:
        d = int_view(new).to(torch.int64) - int_view(old).to(torch.int64)
    else:
        mask = (1 << (8 * size)) - 1
        d = (int_view(new).to(torch.int64) & mask) - (int_view(old).to(torch.int64) & mask)
    shifted = d * torch.bitwise_left_shift(torch.ones_like(p), (p % 8) * 8)
    return (shifted * (p // _BLOCK_BYTES + 1)).sum()


def _stack(digests: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(digests) if digests else torch.zeros(0, dtype=torch.int64)


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


@dataclass
class Encoded:
    """One tensor's part of a delta push: ``parts`` [(wire name, tensor)]: none (unchanged), the
    whole tensor, or its changed positions and their values; ``changed`` values that differ."""

    parts: list[tuple[str, torch.Tensor]]
    changed: int
    idx: torch.Tensor | None = None  # the changed flat positions (int64), if any


def encode(name: str, new: torch.Tensor, old: torch.Tensor) -> Encoded:
    """``new`` against ``old`` (same shape and dtype, same device), bit for bit. Sparse (``#idx``
    flat positions, ``#val`` values of ``new`` there) iff that is fewer bytes than ``new`` whole."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(
            f"{name}: cannot encode a change of shape or dtype ({tuple(old.shape)} {old.dtype} -> "
            f"{tuple(new.shape)} {new.dtype}); the push must be full"
        )
    idx = (int_view(new) != int_view(old)).nonzero().view(-1)
    k, n, size = idx.numel(), new.numel(), new.element_size()
    if k == 0:
        return Encoded([], 0)
    ix = index_dtype(n)
    if k * (ix.itemsize + size) < n * size:
        return Encoded([(name + IDX, idx.to(ix)), (name + VAL, new.contiguous().view(-1)[idx])], k, idx)
    return Encoded([(name, new)], k, idx)


@dataclass
class PushStats:
    """What one push of ``EncodedWeights`` carried: values changed since the last push (of all
    values), tensors sent sparse / whole / not at all, and the encoding."""

    encoding: str = ""
    values: int = 0
    changed: int = 0
    sparse: int = 0
    whole: int = 0
    unchanged: int = 0
    bytes: int = 0

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.values if self.values else 0.0


class EncodedWeights:
    """The learner's side: a source (``common.weights.source.ModelWeights``) pushed as ``full`` or
    ``delta`` against the copy of what the fleet last received, kept in host memory on rank 0
    (``keep``; the other ranks, under ZeRO-3, only take part in the gathers).

    ``prepare(whole)`` is called on every rank at the start of a push, before the metadata: a
    delta push reads the weights (gathers under ZeRO-3) and encodes them then, keeping the wire
    tensors (on the weights' device) until the push ends; a full push is read lazily while it is
    sent, as a plain push is. Either updates the copy; ``generation`` counts the pushes that
    changed it (a server that received generation g holds the copy iff g is still current)."""

    lora = None

    def __init__(self, source: Any, *, keep: bool) -> None:
        self.source, self.keep = source, keep
        self.module, self.zero3 = source.module, source.zero3
        self.copy: dict[str, torch.Tensor] = {}  # name -> host tensor, the last pushed values
        self.digests: dict[str, torch.Tensor] = {}  # name -> digest of copy[name] (on the weights' device)
        self.generation = 0
        self.stats = PushStats()
        self._whole = True
        self._pairs: list[tuple[str, torch.Tensor]] = []
        self._meta: list[ParamMeta] = []

    @property
    def dtype(self) -> torch.dtype | None:
        return self.source.dtype

    @property
    def aliases(self) -> dict[str, str]:
        # A full push names the tied tensors; the servers keep them with their base.
        return dict(self.source.aliases) if self._whole else {}

    @property
    def encoding(self) -> str:
        return "full" if self._whole else "delta"

    def prepare(self, whole: bool) -> None:
        """Readies this push (every rank). ``whole``: a full push (some target lacks the base)."""
        # The other ranks (ZeRO-3) keep no copy: they follow rank 0's choice, passed as ``whole``.
        self._whole = whole or (self.keep and not self.copy)
        self._pairs, self.stats = [], PushStats(encoding=self.encoding)
        base = self.source.metadata()
        if self._whole:
            self._meta = [*base, ParamMeta(DIGEST, torch.int64, (len(base),))]
            self.stats.values = sum(torch.Size(m.shape).numel() for m in base)
            self.stats.whole, self.stats.bytes = len(base), self.nbytes()
            return
        digests, modified = [], False
        try:
            for name, t in self.source:  # ZeRO-3: a gather per layer, on every rank
                if not self.keep:
                    continue
                old = self.copy[name].to(t.device, non_blocking=True)
                enc = encode(name, t, old)
                self._pairs += enc.parts
                self._count(t, enc.changed, len(enc.parts))
                if enc.changed:
                    modified = True
                    if len(enc.parts) == 2:  # sparse: the digest and the copy move by the changed values alone
                        assert enc.idx is not None
                        values = enc.parts[1][1]
                        change = digest_change(enc.idx, values, old.view(-1)[enc.idx])
                        self.digests[name] = self.digests[name] + change
                        self.copy[name].view(-1)[enc.idx.to(self.copy[name].device)] = values.to(self.copy[name].device)
                    else:
                        self.digests[name] = digest(t)
                        self.copy[name].copy_(t)
                digests.append(self.digests[name])
        finally:
            # A copy modified, even by a push that broke half-way, is no server's base any more.
            self.generation += modified
        if self.keep:
            self._pairs.append((DIGEST, _stack(digests)))
            self._meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._pairs]
            self.stats.bytes = self.nbytes()

    def _count(self, t: torch.Tensor, changed: int, parts: int) -> None:
        s = self.stats
        s.values += t.numel()
        s.changed += changed
        s.sparse += parts == 2
        s.whole += parts == 1
        s.unchanged += parts == 0

    def metadata(self) -> list[ParamMeta]:
        return list(self._meta)

    def nbytes(self) -> int:
        return sum(torch.Size(m.shape).numel() * m.dtype.itemsize for m in self._meta)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        if not self._whole:
            yield from self._pairs  # encoded by prepare (on the other ranks: nothing, no gathers)
            return
        digests, modified = [], False
        try:
            for name, t in self.source:  # the plain path's gathers, lazily
                if t is None or not self.keep:
                    yield name, t
                    continue
                digests.append(digest(t))
                self.digests[name] = digests[-1]
                host = t.to("cpu")
                old = self.copy.get(name)
                if old is None or old.shape != host.shape or old.dtype != host.dtype:
                    modified = True
                    self.copy[name] = host.clone() if host is t else host
                elif bool((int_view(host) != int_view(old)).any()):
                    modified = True
                    old.copy_(host)
                yield name, t
            if self.keep:
                yield DIGEST, _stack(digests)
        finally:
            self.generation += modified

    def end(self) -> None:
        """Drops the wire tensors of the push that ended (a delta push holds them until then)."""
        self._pairs = []


# --------------------------------------------------------------------------- the servers' side


@dataclass
class _Receive:
    encoding: str
    pending: dict[str, torch.Tensor] = field(default_factory=dict)  # NAME#idx awaiting its #val
    digests: torch.Tensor | None = None
    touched: set[str] = field(default_factory=set)
    # Tensors whose #idx held positions outside them (clamped so that the scatter cannot fault
    # the device; the push fails at end()): a device flag each, read once at the end.
    out_of_range: list[tuple[str, torch.Tensor]] = field(default_factory=list)


class DigestMismatch(RuntimeError):
    """A push whose result differs from what the learner sent: the server's base is dropped."""


class DeltaBase:
    """A server worker's copy of the last pushed weights (on its device), which delta pushes
    apply to. Use: ``begin(encoding)``; hand every received (wire name, tensor) to ``take``
    (``sink`` is a stand-in model whose ``load_weights`` does that, for a weight-transfer
    engine's receive loop); ``end()`` checks the digests and returns the (name, tensor) pairs
    to load into the model, tied names included. Any failure leaves no base: only a full push
    is taken after it."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}  # in the order of the last full push
        self.aliases: dict[str, str] = {}  # tied name -> the base name loaded under it too
        self.valid = False
        self._rx: _Receive | None = None

    def begin(self, encoding: str, aliases: dict[str, str] | None = None) -> None:
        if encoding not in SYNCS:
            raise ValueError(f"WeightUpdate.encoding: unknown {encoding!r} (known: {', '.join(SYNCS)})")
        if encoding == "delta" and not self.valid:
            raise RuntimeError(
                "delta push to a server without a base (a failed or partial push dropped it): a full push must land first"
            )
        if encoding == "full":
            self.tensors, self.aliases = {}, dict(aliases or {})
        self.valid = False  # until end() has checked this push
        self._rx = _Receive(encoding)

    def take(self, name: str, t: torch.Tensor) -> None:
        rx = self._rx
        if rx is None:
            raise RuntimeError(f"received {name} outside a push (begin first)")
        if name == DIGEST:
            rx.digests = t.to(torch.int64).to(self.device, copy=True)
        elif name.endswith(IDX):
            # A copy: the engine may reuse this buffer for the next bucket before #val arrives.
            rx.pending[name[: -len(IDX)]] = t.to(self.device, torch.int64, copy=True)
        elif name.endswith(VAL):
            base_name = name[: -len(VAL)]
            idx = rx.pending.pop(base_name, None)
            base = self.tensors.get(base_name)
            if idx is None or base is None:
                raise RuntimeError(f"{name}: {'no base tensor' if base is None else 'no #idx before it'}")
            if idx.numel() != t.numel():
                raise RuntimeError(f"{name}: {t.numel()} values for {idx.numel()} indices")
            # No host sync per tensor: an index outside the tensor (a corrupted push) is clamped
            # (on a GPU it would fault the device) and reported by end().
            rx.out_of_range.append((base_name, ((idx < 0) | (idx >= base.numel())).any()))
            base.view(-1)[idx.clamp_(0, base.numel() - 1)] = t.to(self.device).view(-1)
            rx.touched.add(base_name)
        elif rx.encoding == "full":
            self.tensors[name] = t.to(self.device, copy=True)
        else:
            base = self.tensors.get(name)
            if base is None or base.shape != t.shape or base.dtype != t.dtype:
                raise RuntimeError(f"{name}: whole tensor {tuple(t.shape)} {t.dtype} does not match the base's")
            base.copy_(t)
            rx.touched.add(name)

    def sink(self) -> _Sink:
        return _Sink(self)

    def end(self) -> list[tuple[str, torch.Tensor]]:
        """Checks every tensor's digest; returns what to load. Raises ``DigestMismatch`` naming
        the tensors that differ (and the base is dropped)."""
        rx, self._rx = self._rx, None
        if rx is None:
            raise RuntimeError("end() without begin()")
        if rx.pending:
            raise RuntimeError(f"push ended with indices but no values for {sorted(rx.pending)[:3]}")
        names = list(self.tensors)
        if rx.digests is None or rx.digests.numel() != len(names):
            got = "none" if rx.digests is None else rx.digests.numel()
            raise DigestMismatch(f"push ended with {got} digests for {len(names)} tensors")
        if rx.out_of_range:
            flags = torch.stack([f for _, f in rx.out_of_range]).tolist()  # one host sync
            outside = [n for (n, _), f in zip(rx.out_of_range, flags, strict=True) if f]
            if outside:
                raise DigestMismatch(
                    f"{rx.encoding} push: indices outside {', '.join(outside[:3])}; this server's copy is dropped "
                    "and it serves nothing until a full push lands"
                )
        ours = torch.stack([digest(t) for t in self.tensors.values()]) if names else rx.digests
        bad = (ours != rx.digests).nonzero().view(-1).tolist()  # one host sync per push
        if bad:
            first = ", ".join(names[i] for i in bad[:3])
            raise DigestMismatch(
                f"{rx.encoding} push: {len(bad)} of {len(names)} tensors differ from what the learner sent "
                f"after applying it ({first}{', ...' if len(bad) > 3 else ''}); this server's copy is dropped "
                "and it serves nothing until a full push lands"
            )
        self.valid = True
        loaded_as: dict[str, list[str]] = {}
        for alias, name in self.aliases.items():
            loaded_as.setdefault(name, []).append(alias)
        return [(n, t) for name, t in self.tensors.items() for n in (name, *loaded_as.get(name, ()))]

    def drop(self) -> None:
        self.tensors, self.valid, self._rx = {}, False, None


class _Sink:
    """Stands in for the model during a receive: every (wire name, tensor) goes to the base."""

    def __init__(self, base: DeltaBase) -> None:
        self.base = base

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = set()
        for name, t in pairs:
            self.base.take(name, t)
            names.add(name)
        return names
