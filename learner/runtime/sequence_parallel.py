"""Sequence parallelism across learner ranks (issue 41's second part; ``--ds.ring_attn_size N``,
alias ``--ds.sequence_parallel_size``): one micro-batch's sequence dimension split over N ranks.

Algorithm: Ulysses (DeepSpeed's ``UlyssesSPAttentionHF``), not ring attention, whatever OpenRLHF's
flag name says. Every rank of a sequence-parallel (SP) group runs the model on its own 1/N of the
columns; at each attention layer an all-to-all swaps "my columns, all heads" for "all columns, my
heads", the attention runs over the whole sequence on H/N heads, and a second all-to-all swaps back.
Everything else (embeddings, MLPs, norms, the output head) only ever sees the rank's columns, so
a rank's activations are 1/N of the sequence's. N must divide the attention heads and the KV heads.

The ranks: ``init_groups(N)`` cuts the world into SP groups of N consecutive ranks; the groups
are data parallel among themselves (``data_parallel()``: this rank's DP rank and size, the group
of its peers at the same SP rank). Every rank of an SP group takes the same samples and runs the
same micro-batches (the trainer slices the train batch by DP rank, not by rank).

What is taken from DeepSpeed and what is not (docs/long-context.md):

* ``UlyssesSPAttentionHF`` itself (the all-to-alls, their autograd, GQA head bookkeeping): used,
  constructed here with its public constructor, one per micro-batch row count (its shapes are
  fixed per instance);
* ``UlyssesSPAttentionHF.register_with_transformers``: not used. It overrides the attention kernel
  for every model of the process (the critic, a reference model) and drops every mask, relying on
  causality alone, so under SDPA packed samples would attend to each other. Here the kernel entry
  is replaced by a dispatcher that splits only the modules of registered models, and the core
  attention after the all-to-all gets a block-diagonal causal mask rebuilt from the gathered
  position ids when a row holds more than one sample (``segment_causal_mask``); rows holding one
  sample (the unpacked layout, re-laid below) keep SDPA's ``is_causal`` with no mask;
* ``UlyssesSPDataLoaderAdapter`` (shards a dataloader's batches): not used; the RL trainer's
  micro-batches are planned per pass (``learner.rl.micro_batches``), and ``split_layout`` shards one;
* DeepSpeed's own SP groups (``parallel_state_sp``, passed as ``mpu``): not used. DeepSpeed is not
  told about the split: it reduces gradients over every rank and divides by the world, which the
  trainers' loss scale (ranks x accumulation) undoes, so a group's ranks' gradient shares are
  summed (test: tests/unit/runtime/test_sequence_parallel.py).

The layout (``split_layout``): the rows are re-laid with each row's tokens from column 0 (padded
rows lose their left padding; a packed row is one row), right-padded to a multiple of N with the
row's last token and position ids that continue (pads attend only backwards and are never
counted, so they change no counted token), and cut into N column shards. Per-token log-probs are
computed shard-locally (through ``common.tiled_logits`` in tiles, as unsplit) and all-gathered
(K floats); the gather's backward hands each rank its own tokens' gradient, so with the same loss
on every rank of the group the parameters' gradients summed over the group are the unsplit ones.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.tiled_logits import head_inputs, token_logprobs
from common.weights.source import unwrap
from learner.algorithms.losses import entropy_from_logits, log_probs_from_logits
from learner.algorithms.packing import unpack_to_padded
from learner.runtime.lora import base_hf_model

__all__ = [
    "FLAG",
    "SPGroups",
    "init_groups",
    "groups",
    "data_parallel",
    "check_heads",
    "register",
    "split_of",
    "segment_causal_mask",
    "split_layout",
    "response_logprobs",
    "response_values",
]

log = logging.getLogger(__name__)

FLAG = "--ds.ring_attn_size (--ds.sequence_parallel_size, --ring_attn_size)"
# Core attention kernels the split supports: SDPA with the mask rebuilt here (tested on CPU), and
# flash-attention, whose varlen path finds samples in the gathered position ids (DeepSpeed's use).
SPLIT_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class SPGroups:
    """This rank's place: ``rank`` in its SP group of ``size``; ``dp_rank`` of ``dp_size`` groups."""

    size: int
    rank: int
    group: Any  # ProcessGroup of the SP group; None when size == 1
    dp_rank: int
    dp_size: int
    dp_group: Any  # ProcessGroup of the ranks at this SP rank in every group; None: the world


_GROUPS: SPGroups | None = None


def init_groups(size: int) -> SPGroups:
    """Cut the world into SP groups of ``size`` consecutive ranks (a collective: every rank calls it,
    once per process). ``size`` 1: no split, nothing created."""
    global _GROUPS
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if size < 1 or world % size:
        raise ValueError(f"{FLAG} {size}: must be >= 1 and divide the number of learner ranks ({world})")
    if _GROUPS is not None:
        if _GROUPS.size != size:
            raise ValueError(f"{FLAG}: sequence-parallel groups of {_GROUPS.size} exist, {size} asked")
        return _GROUPS
    if size == 1:
        _GROUPS = SPGroups(1, 0, None, rank, world, None)
        return _GROUPS
    sp_group = dp_group = None
    for start in range(0, world, size):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            sp_group = g
    for offset in range(size):
        g = dist.new_group(list(range(offset, world, size)))
        if rank % size == offset:
            dp_group = g
    _GROUPS = SPGroups(size, rank % size, sp_group, rank // size, world // size, dp_group)
    return _GROUPS


def groups() -> SPGroups | None:
    """The groups ``init_groups`` made, or None."""
    return _GROUPS


def data_parallel() -> tuple[int, int, Any]:
    """(DP rank, DP size, DP group or None for the world): how the trainers slice and gather samples.
    Without a split: the rank, the world, None."""
    if _GROUPS is not None and _GROUPS.size > 1:
        return _GROUPS.dp_rank, _GROUPS.dp_size, _GROUPS.dp_group
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return rank, world, None


def check_heads(config: Any, size: int) -> None:
    """ValueError naming the flag when ``size`` does not divide the model's attention and KV heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % size or kv % size:
        raise ValueError(
            f"{FLAG} {size}: Ulysses sequence parallelism splits the attention heads over the {size} ranks of a "
            f"group, so {size} must divide the model's {heads} attention heads and {kv} KV heads "
            f"({getattr(config, 'name_or_path', '') or type(config).__name__})"
        )


def segment_causal_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(B, 1, L, L) bool: query q sees key k when k <= q and both are in the same sample, a sample
    starting where the position id is 0; None when every row holds one sample (causal alone is exact).

    ``position_ids``: (B, L), the whole sequence's (Ulysses gathers them before the core attention)."""
    starts = position_ids == 0  # (B, L)
    if int(starts.sum(-1).max()) <= 1:  # a sync point per layer; only SDPA's path takes it
        return None
    seg = starts.long().cumsum(-1)  # (B, L) sample number of each column
    L = position_ids.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=position_ids.device).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


class _Split:
    """One registered model's Ulysses attention: one DeepSpeed instance per row count."""

    def __init__(self, config: Any, core: Callable[..., Any], sp: SPGroups) -> None:
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.core = core
        self.sp = sp
        self.by_rows: dict[int, Any] = {}

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        rows = query.shape[0]
        uattn = self.by_rows.get(rows)
        if uattn is None:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            c = self.config
            uattn = UlyssesSPAttentionHF(
                attn=self.core,
                batch_size=rows,
                attn_head_count=c.num_attention_heads,
                attn_head_size=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                kv_head_count=c.num_key_value_heads,
                num_hidden_layers=c.num_hidden_layers,
                process_group=self.sp.group,
                seq_length_is_variable=True,
            )
            self.by_rows[rows] = uattn
        # The model built its mask for the shard's columns; it is meaningless for the whole sequence.
        return uattn(module, query, key, value, None, *args, **kwargs)


# The attention modules of registered models -> their split; the kernels whose entry is replaced.
_SPLIT_MODULES: weakref.WeakKeyDictionary[torch.nn.Module, _Split] = weakref.WeakKeyDictionary()
_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _install_dispatcher(impl: str) -> Callable[..., Any]:
    """Replace transformers' kernel entry ``impl`` by one that splits registered models' modules and
    calls the original kernel for every other model; returns the original."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl in _ORIGINAL:
        return _ORIGINAL[impl]
    original = ALL_ATTENTION_FUNCTIONS[impl]
    _ORIGINAL[impl] = original

    def dispatch(module, query, key, value, attention_mask, *args, **kwargs):
        split = _SPLIT_MODULES.get(module)
        if split is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        return split(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = dispatch
    return original


def _core_attention(impl: str, original: Callable[..., Any]) -> Callable[..., Any]:
    if impl != "sdpa":
        return original  # flash-attention's varlen path reads the samples from the position ids

    def sdpa_with_samples(module, query, key, value, attention_mask, *args, **kwargs):
        mask = segment_causal_mask(kwargs["position_ids"])  # gathered: (B, L) of the whole sequence
        return original(module, query, key, value, mask, *args, **kwargs)

    return sdpa_with_samples


def register(model: Any, sp: SPGroups) -> None:
    """Split ``model``'s attention over ``sp``'s group (a DeepSpeed engine, a peft model or an HF
    model). From then on every forward of the model must be a split one (``response_logprobs``)."""
    if sp.size == 1:
        return
    hf = base_hf_model(unwrap(model))
    config = hf.config
    check_heads(config, sp.size)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in SPLIT_ATTENTION:
        raise ValueError(
            f"{FLAG} {sp.size}: the model's attention implementation is {impl!r}; the sequence split needs one of "
            f"{', '.join(SPLIT_ATTENTION)} (--ds.attn_implementation)"
        )
    split = _Split(config, _core_attention(impl, _install_dispatcher(impl)), sp)
    for module in hf.modules():
        _SPLIT_MODULES[module] = split


def split_of(model: Any) -> SPGroups | None:
    """The groups ``model`` (engine, peft or HF model) is split over, or None when it is not split."""
    hf = base_hf_model(unwrap(model))
    split = _SPLIT_MODULES.get(hf)
    return split.sp if split is not None else None


@dataclass
class Layout:
    """A micro-batch re-laid for the split. ``input_ids``/``position_ids``: (B, L) with L a multiple
    of the group's size, each row's tokens from column 0; ``cols``: (K,) flat indices into (B, L) of
    the columns whose output predicts the counted tokens, in ``action_mask``'s row-major order."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cols: torch.Tensor


def _pad_to(ids: torch.Tensor, pos: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (B, L) rows to ``width``: the last token repeated, positions continuing."""
    extra = width - ids.shape[1]
    if extra == 0:
        return ids, pos
    steps = torch.arange(1, extra + 1, device=pos.device)
    return (
        torch.cat([ids, ids[:, -1:].expand(-1, extra)], dim=1),
        torch.cat([pos, pos[:, -1:] + steps], dim=1),
    )


def split_layout(batch: dict[str, Any], size: int) -> Layout:
    """The micro-batch (``learner.rl.experience.collate``'s padded or packed layout) as ``Layout``."""
    mask = batch["action_mask"].bool()  # (N, T)
    if "logit_index" in batch:  # packed: one row, samples already from column 0
        ids, pos = batch["input_ids"], batch["position_ids"]  # (1, L)
        width = math.ceil(ids.shape[1] / size) * size
        ids, pos = _pad_to(ids, pos, width)
        return Layout(ids, pos, batch["logit_index"])
    am = batch["attention_mask"].bool()  # (N, W): left-padded prompt, right-padded response
    N, W = am.shape
    first = (~am).long().cumprod(-1).sum(-1)  # (N,) leading pad columns
    lengths = am.sum(-1)  # (N,)
    width = math.ceil(int(lengths.max()) / size) * size
    j = torch.arange(width, device=am.device)
    src = (first[:, None] + j[None]).clamp(max=W - 1)  # (N, width)
    ids = batch["input_ids"].gather(1, src)
    last = batch["input_ids"].gather(1, (first + lengths - 1)[:, None])  # (N, 1) the row's last token
    ids = torch.where(j[None] < lengths[:, None], ids, last)
    pos = j[None].expand(N, -1).clone()  # real tokens 0 .. len-1, pads continuing
    P = batch["prompt_width"]
    rows, t = mask.nonzero(as_tuple=True)  # row-major
    cols = rows * width + (P - 1 + t - first[rows])  # column P-1+t predicts response token t
    return Layout(ids, pos, cols)


class _GatherTokens(torch.autograd.Function):
    """The group's per-token values in global order from each rank's own; backward: the rank's own
    tokens' gradient (every rank computes the same loss on the gathered values, so the gradients of
    one copy, summed over the group by DeepSpeed's reduction, are the unsplit ones)."""

    @staticmethod
    def forward(ctx, local, anchor, owned, group):
        ctx.owned = owned
        ctx.rank = dist.get_rank(group)
        ctx.anchor_shape = anchor.shape
        width = max(1, max(len(o) for o in owned))
        buf = local.new_zeros(width)
        buf[: local.shape[0]] = local
        pieces = [torch.empty_like(buf) for _ in owned]
        dist.all_gather(pieces, buf.contiguous(), group=group)
        total = sum(len(o) for o in owned)
        out = local.new_empty(total)
        for piece, idx in zip(pieces, owned, strict=True):
            out[idx] = piece[: len(idx)]
        return out

    @staticmethod
    def backward(ctx, grad):
        # ``anchor`` (the shard's hidden states) gets a zero gradient: a rank with no counted token in
        # its shard still runs its backward through every layer, whose all-to-alls are collectives.
        zero = grad.new_zeros(ctx.anchor_shape)
        return grad[ctx.owned[ctx.rank]], zero, None, None


def response_logprobs(
    model: Any,
    batch: dict[str, Any],
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    tile_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``learner.rl.policy_trainer.response_logprobs`` with the sequence split over the SP group:
    (N, T) log-probs of the ``action_mask`` tokens (0 elsewhere), and their entropy, equal on every
    rank of the group. Tiled through ``common.tiled_logits`` when ``tile_tokens`` > 0 and the model
    allows it, else the shard's own logits (1/N of the sequence's)."""
    from learner.runtime.models import tileable

    sp, shard = _shard(batch)
    B, S, shard_ids, shard_pos, local_rows = shard.rows, shard.width, shard.input_ids, shard.position_ids, shard.local
    mask = batch["action_mask"].bool()
    labels = batch["response"][mask][shard.owned[sp.rank]]
    hf = base_hf_model(unwrap(model))
    entropy = "none" if not with_entropy else "grad" if entropy_grad else "metric"
    if tile_tokens > 0 and tileable(hf):
        head = hf.get_output_embeddings()
        hidden = head_inputs(
            model, head, input_ids=shard_ids, position_ids=shard_pos, use_cache=False, logits_to_keep=0
        )
        rows = hidden.reshape(B * S, -1)[local_rows]  # (K_r, H)
        lp, ent = token_logprobs(head, rows, labels, temperature=temperature, tile_tokens=tile_tokens, entropy=entropy)
        anchor = hidden
    else:
        logits = model(input_ids=shard_ids, position_ids=shard_pos, use_cache=False).logits  # (B, S, V)
        rows = logits.reshape(B * S, -1)[local_rows]  # (K_r, V)
        lp = log_probs_from_logits(rows[None], labels[None], temperature=temperature)[0].float()
        ent = None
        if entropy == "grad":
            ent = entropy_from_logits(rows[None], temperature=temperature)[0].float()
        elif entropy == "metric":
            with torch.no_grad():
                ent = entropy_from_logits(rows.detach()[None], temperature=temperature)[0].float()
        anchor = logits
    lp = _GatherTokens.apply(lp, anchor, shard.owned, sp.group)
    if ent is not None:
        if ent.requires_grad:
            ent = _GatherTokens.apply(ent, anchor, shard.owned, sp.group)
        else:
            with torch.no_grad():
                ent = _GatherTokens.apply(ent.detach(), ent.new_zeros(0), shard.owned, sp.group)
    return unpack_to_padded(lp, mask), (unpack_to_padded(ent, mask) if ent is not None else None)


def response_values(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """``learner.rl.critic.response_values`` with the sequence split: (N, T) values of the states
    before each ``action_mask`` token (0 elsewhere), equal on every rank of the group. ``model``:
    the critic (``forward(input_ids, attention_mask, position_ids) -> (B, L)``)."""
    sp, shard = _shard(batch)
    v = model(shard.input_ids, None, shard.position_ids)  # (B, S) of this rank's columns
    mine = v.reshape(-1)[shard.local]
    values = _GatherTokens.apply(mine, v, shard.owned, sp.group)
    return unpack_to_padded(values, batch["action_mask"].bool())


@dataclass
class _Shard:
    """This rank's columns of a ``Layout``: (rows, width) ids and positions; ``owned[r]``: the counted
    tokens (indices into K) rank r's columns predict; ``local``: this rank's, as flat indices into
    its (rows * width) outputs."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    rows: int
    width: int
    owned: list[torch.Tensor]
    local: torch.Tensor


def _shard(batch: dict[str, Any]) -> tuple[SPGroups, _Shard]:
    sp = _GROUPS
    assert sp is not None and sp.size > 1, "a split forward needs sequence_parallel.init_groups(N > 1)"
    layout = split_layout(batch, sp.size)
    B, L = layout.input_ids.shape
    S = L // sp.size  # the shard's columns
    lo = sp.rank * S
    col = layout.cols % L
    owner = col // S  # (K,) the rank whose shard holds each predicting column
    owned = [(owner == r).nonzero(as_tuple=True)[0] for r in range(sp.size)]
    mine = owned[sp.rank]
    local = (layout.cols[mine] // L) * S + (col[mine] - lo)  # into the shard's (B * S) rows
    ids, pos = layout.input_ids[:, lo : lo + S], layout.position_ids[:, lo : lo + S]
    return sp, _Shard(ids, pos, B, S, owned, local)
