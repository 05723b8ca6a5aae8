"""Packing several per-token tensors into one uint8 row, so one collective moves them together.

Every field is carried as raw bytes (fp8 included: gloo cannot move float8 tensors, a uint8 view
can), so the row format is independent of what the backend supports.

Shape legend: R rows, B bytes per row, X elements of a field per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class RowField:
    """One field of a row: `width` elements of `dtype`."""

    name: str
    dtype: torch.dtype
    width: int

    def __post_init__(self) -> None:
        if not isinstance(self.width, int) or self.width < 1:
            raise ValueError(f"RowField.width ({self.width!r}) of field {self.name!r} must be an int >= 1")

    @property
    def nbytes(self) -> int:
        return self.width * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RowFormat:
    """An ordered tuple of fields; a packed row is their bytes back to back."""

    fields: tuple[RowField, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"RowFormat field names ({names}) must be distinct")
        if not self.fields:
            raise ValueError("RowFormat needs at least one field")

    @property
    def row_bytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """tensors[i] (R, fields[i].width) of fields[i].dtype -> (R, row_bytes) uint8."""
        if len(tensors) != len(self.fields):
            raise ValueError(f"pack got {len(tensors)} tensors for {len(self.fields)} fields")
        R = tensors[0].size(0)
        parts = []
        for f, t in zip(self.fields, tensors):
            if t.dtype != f.dtype or tuple(t.shape) != (R, f.width):
                raise ValueError(
                    f"field {f.name!r} must be ({R}, {f.width}) {f.dtype}, got {tuple(t.shape)} {t.dtype}"
                )
            parts.append(t.contiguous().view(torch.uint8).reshape(R, f.nbytes))
        return torch.cat(parts, dim=1)

    def unpack(self, rows_RB: torch.Tensor) -> dict[str, torch.Tensor]:
        """(R, row_bytes) uint8 -> {field name: (R, width) tensor of the field's dtype}."""
        if rows_RB.dim() != 2 or rows_RB.size(1) != self.row_bytes or rows_RB.dtype != torch.uint8:
            raise ValueError(
                f"rows must be (R, {self.row_bytes}) uint8, got {tuple(rows_RB.shape)} {rows_RB.dtype}"
            )
        out, off = {}, 0
        for f in self.fields:
            chunk = rows_RB[:, off:off + f.nbytes].contiguous()
            out[f.name] = chunk.view(f.dtype).reshape(rows_RB.size(0), f.width)
            off += f.nbytes
        return out
