"""Torch dtype names: one table for all of ``common/``.

The tensor wire (``common/serialization.py``) and weight sync (``common/weights/``,
``WeightUpdate.dtype_names``) both name dtypes by the attribute of ``torch`` they resolve to
("bfloat16" for ``torch.bfloat16``). No torch import at module load: ``common.serialization``
is imported by processes that decide late whether they need torch.
"""

from __future__ import annotations

from typing import Any

# Wire name -> torch dtype attribute name: the dtypes tensor headers may carry. The wire name
# travels between processes of different versions: append, never rename.
DTYPES: dict[str, str] = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float64": "float64",
}

# Short spellings people write in configs and flags.
ALIASES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> "bfloat16": the name ``torch_dtype`` turns back into the dtype."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> Any:
    """The torch dtype called ``name`` exactly (a name that came over the wire: no aliases)."""
    import torch

    got = getattr(torch, name, None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return got


def to_dtype(d: Any) -> Any:
    """A torch dtype from a dtype, a name ("bfloat16") or an alias ("bf16"); None stays None."""
    import torch

    if d is None or isinstance(d, torch.dtype):
        return d
    got = getattr(torch, ALIASES.get(d, d), None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"unknown dtype {d!r}")
    return got
