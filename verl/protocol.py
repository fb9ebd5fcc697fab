"""DataProto: the batch that flows between driver and workers (docs/design.md#one-training-step).

A `TensorDict` of tensors sharing the leading batch dimension, a dict of numpy object arrays of
the same length (uids, raw prompts, ground truths), and a free-form `meta_info` dict. Every
operation keeps the three in step and fails with a clear message on mismatched sizes or
conflicting keys. Pickles cleanly, so it crosses Ray process boundaries as is.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

IndexLike = int | slice | Sequence[int] | np.ndarray | torch.Tensor


def _object_array(values: Any) -> np.ndarray:
    """A 1-D numpy object array with one element per row (a list value stays one element)."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _check_sizes(
    tensors: dict[str, torch.Tensor], non_tensors: dict[str, np.ndarray]
) -> int | None:
    sizes = {f"tensor '{k}'": v.shape[0] for k, v in tensors.items()}
    sizes.update({f"non-tensor '{k}'": len(v) for k, v in non_tensors.items()})
    if len(set(sizes.values())) > 1:
        detail = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(f"DataProto batch-size mismatch: {detail}")
    return next(iter(sizes.values()), None)


def _indices(index: IndexLike, length: int) -> np.ndarray:
    if isinstance(index, slice):
        return np.arange(length)[index]
    if isinstance(index, torch.Tensor):
        index = index.cpu().numpy()
    arr = np.asarray(index)
    if arr.dtype == bool:
        if arr.shape[0] != length:
            raise ValueError(
                f"boolean index of length {arr.shape[0]} for a DataProto of length {length}"
            )
        return np.nonzero(arr)[0]
    arr = arr.astype(np.int64).reshape(-1)
    if arr.size and (arr.max() >= length or arr.min() < -length):
        raise IndexError(
            f"index {int(arr.max() if arr.max() >= length else arr.min())} out of range for length {length}"
        )
    return arr


def _merge_meta(a: dict, b: dict, what: str) -> dict:
    out = dict(a)
    for key, value in b.items():
        if key in out and not _equal(out[key], value):
            raise ValueError(f"{what}: meta_info key '{key}' conflicts ({out[key]!r} vs {value!r})")
        out[key] = value
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray | list | tuple) or isinstance(b, np.ndarray | list | tuple):
        if not isinstance(a, np.ndarray | list | tuple) or not isinstance(
            b, np.ndarray | list | tuple
        ):
            return False
        if len(a) != len(b):
            return False
        if (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype != object
            and b.dtype != object
        ):
            return a.shape == b.shape and bool(np.array_equal(a, b))
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    result = a == b
    return bool(result) if not isinstance(result, np.ndarray) else bool(result.all())


@dataclass
class DataProtoItem:
    """One row of a DataProto: tensors without the batch dimension, plain non-tensor values."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto:
    """Tensor batch (TensorDict) + numpy object non-tensor batch + meta_info, kept in step."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {k: _object_array(v) for k, v in self.non_tensor_batch.items()}
        tensors = dict(self.batch.items()) if self.batch is not None else {}
        _check_sizes(tensors, self.non_tensor_batch)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build from a dict of tensors (same first dimension) and a dict of per-row values."""
        tensors = tensors or {}
        non_tensors = {k: _object_array(v) for k, v in (non_tensors or {}).items()}
        size = _check_sizes(tensors, non_tensors)
        batch = TensorDict(dict(tensors), batch_size=[size]) if tensors else None
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None
    ) -> DataProto:
        """Split one dict into tensors (torch.Tensor values) and non-tensors (everything else)."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info)

    # ------------------------------------------------------------------ basic protocol
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def __getitem__(self, index: IndexLike) -> DataProto | DataProtoItem:
        if isinstance(index, int | np.integer):
            batch = self.batch[int(index)] if self.batch is not None else None
            non_tensors = {k: v[int(index)] for k, v in self.non_tensor_batch.items()}
            return DataProtoItem(
                batch=batch, non_tensor_batch=non_tensors, meta_info=self.meta_info
            )
        return self.index_select(index)

    def keys(self) -> list[str]:
        """Tensor keys then non-tensor keys."""
        return list(self.batch.keys() if self.batch is not None else []) + list(
            self.non_tensor_batch
        )

    def __contains__(self, key: str) -> bool:
        return key in self.keys()

    def to(self, device: torch.device | str) -> DataProto:
        """Move the tensors to `device` (in place) and return self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    # ------------------------------------------------------------------ key operations
    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A view with only the named keys (all of a kind when its argument is None)."""
        batch = self.batch
        if batch_keys is not None:
            batch_keys = list(batch_keys)
            self._require(batch_keys, batch.keys() if batch is not None else [], "tensor")
            batch = batch.select(*batch_keys) if batch is not None else None
        non_tensors = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            self._require(non_tensor_batch_keys, non_tensors, "non-tensor")
            non_tensors = {k: non_tensors[k] for k in non_tensor_batch_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            self._require(meta_info_keys, meta, "meta_info")
            meta = {k: meta[k] for k in meta_info_keys}
        out = DataProto(batch=batch, non_tensor_batch=dict(non_tensors), meta_info=dict(meta))
        return copy.deepcopy(out) if deepcopy else out

    def pop(
        self,
        batch_keys: Iterable[str] = (),
        non_tensor_batch_keys: Iterable[str] = (),
        meta_info_keys: Iterable[str] = (),
    ) -> DataProto:
        """Remove the named keys from self and return them as a new DataProto."""
        batch_keys, non_tensor_batch_keys, meta_info_keys = (
            list(batch_keys),
            list(non_tensor_batch_keys),
            list(meta_info_keys),
        )
        self._require(batch_keys, self.batch.keys() if self.batch is not None else [], "tensor")
        self._require(non_tensor_batch_keys, self.non_tensor_batch, "non-tensor")
        self._require(meta_info_keys, self.meta_info, "meta_info")
        tensors = {k: self.batch.pop(k) for k in batch_keys}
        non_tensors = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return DataProto.from_dict(tensors, non_tensors, meta)

    def rename(self, old_keys: str | list[str], new_keys: str | list[str]) -> DataProto:
        """Rename tensor keys in place."""
        old_keys = [old_keys] if isinstance(old_keys, str) else old_keys
        new_keys = [new_keys] if isinstance(new_keys, str) else new_keys
        self._require(old_keys, self.batch.keys() if self.batch is not None else [], "tensor")
        for old, new in zip(old_keys, new_keys, strict=True):
            self.batch.rename_key_(old, new)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge `other` into self (in place). A key present in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"DataProto.union: batch sizes differ ({len(self)} vs {len(other)})")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch
            else:
                for key, value in other.batch.items():
                    if key in self.batch.keys() and not _equal(self.batch[key], value):
                        raise ValueError(
                            f"DataProto.union: tensor key '{key}' exists in both with different values"
                        )
                    self.batch[key] = value
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not _equal(self.non_tensor_batch[key], value):
                raise ValueError(
                    f"DataProto.union: non-tensor key '{key}' exists in both with different values"
                )
            self.non_tensor_batch[key] = value
        self.meta_info = _merge_meta(self.meta_info, other.meta_info, "DataProto.union")
        return self

    # ------------------------------------------------------------------ row operations
    def index_select(self, index: IndexLike) -> DataProto:
        """Rows at `index` (ints, slice, bool mask, array or tensor), in that order."""
        idx = _indices(index, len(self))
        batch = (
            self.batch[torch.as_tensor(idx, dtype=torch.long)] if self.batch is not None else None
        )
        non_tensors = {k: v[idx] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def replace_rows(self, index: IndexLike, other: DataProto) -> None:
        """Overwrite the rows at `index` with `other`'s rows, in order, in place; both must hold
        the same tensor and non-tensor keys (meta_info is left as it is)."""
        idx = _indices(index, len(self))
        if len(idx) != len(other):
            raise ValueError(f"replace_rows: {len(idx)} rows to replace, {len(other)} given")
        mine = sorted(self.batch.keys()) if self.batch is not None else []
        theirs = sorted(other.batch.keys()) if other.batch is not None else []
        if mine != theirs or sorted(self.non_tensor_batch) != sorted(other.non_tensor_batch):
            raise KeyError(f"replace_rows: keys differ, {mine} vs {theirs} "
                           f"(non-tensor {sorted(self.non_tensor_batch)} vs {sorted(other.non_tensor_batch)})")  # fmt: skip
        rows = torch.as_tensor(idx, dtype=torch.long)
        for key in mine:
            self.batch[key][rows] = other.batch[key].to(self.batch[key].dtype)
        for key, values in other.non_tensor_batch.items():
            self.non_tensor_batch[key][idx] = values

    def reorder(self, indices: IndexLike) -> None:
        """Permute the rows in place."""
        selected = self.index_select(indices)
        if len(selected) != len(self):
            raise ValueError(
                f"reorder needs a permutation of {len(self)} rows, got {len(selected)} indices"
            )
        self.batch, self.non_tensor_batch = selected.batch, selected.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row `repeat_times` times: a a b b (interleave) or a b a b (tile)."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        n = len(self)
        idx = (
            np.repeat(np.arange(n), repeat_times)
            if interleave
            else np.tile(np.arange(n), repeat_times)
        )
        return self.index_select(idx)

    def split(self, split_size: int | Sequence[int]) -> list[DataProto]:
        """Consecutive pieces of `split_size` rows (the last may be shorter), or of the listed sizes."""
        n = len(self)
        if isinstance(split_size, int):
            if split_size < 1:
                raise ValueError(f"split_size must be >= 1, got {split_size}")
            sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
        else:
            sizes = list(split_size)
            if sum(sizes) != n or any(s < 0 for s in sizes):
                raise ValueError(f"split sizes {sizes} do not add up to the batch size {n}")
        bounds = np.cumsum([0, *sizes])
        return [self.index_select(slice(int(a), int(b))) for a, b in itertools.pairwise(bounds)]

    def chunk(self, chunks: int) -> list[DataProto]:
        """`chunks` pieces whose sizes differ by at most one (larger pieces first)."""
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        n = len(self)
        base, extra = divmod(n, chunks)
        return self.split([base + (1 if i < extra else 0) for i in range(chunks)])

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Rows of all parts in order; key sets must agree; meta_info merged (conflicts raise)."""
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        keys = [sorted(d.keys()) for d in data]
        for i, k in enumerate(keys[1:], start=1):
            if k != keys[0]:
                raise ValueError(f"DataProto.concat: part {i} has keys {k}, part 0 has {keys[0]}")
        parts = [d for d in data if len(d)] or [data[0]]
        batch = None
        if parts[0].batch is not None:
            batch = torch.cat([d.batch for d in parts], dim=0)
        non_tensors = {
            k: np.concatenate([d.non_tensor_batch[k] for d in parts])
            for k in parts[0].non_tensor_batch
        }
        meta: dict[str, Any] = {}
        for d in data:
            meta = _merge_meta(meta, d.meta_info, "DataProto.concat")
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    # ------------------------------------------------------------------ padding for data parallel
    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Append copies of leading rows so the length is a multiple of `divisor`; returns (data, pad)."""
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        n = len(self)
        if n == 0:
            raise ValueError("cannot pad an empty DataProto")
        pad = (-n) % divisor
        if pad == 0:
            return self, 0
        idx = np.concatenate([np.arange(n), np.arange(pad) % n])
        return self.index_select(idx), pad

    def unpad(self, pad: int) -> DataProto:
        """Drop the last `pad` rows added by `pad_to_divisor`."""
        return self if pad == 0 else self.index_select(slice(0, len(self) - pad))

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _require(keys: Iterable[str], available: Iterable[str], kind: str) -> None:
        available = list(available)
        missing = [k for k in keys if k not in available]
        if missing:
            raise KeyError(
                f"{kind} key(s) {missing} not in DataProto; available: {sorted(available)}"
            )

    def check_consistency(self) -> None:
        """Raise if tensors and non-tensors disagree on the batch size."""
        tensors = dict(self.batch.items()) if self.batch is not None else {}
        _check_sizes(tensors, self.non_tensor_batch)
