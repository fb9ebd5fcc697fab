"""Tests of DataProto: construction, key and row operations, padding, pickling and Ray transport."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import ray
import torch

from verl.protocol import DataProto, DataProtoItem


def make_data(n: int = 10, meta: dict | None = None) -> DataProto:
    """n rows: tensors keyed by the row index, non-tensors of uneven per-row lists."""
    rows = torch.arange(n)
    return DataProto.from_dict(
        tensors={
            "ids": rows.view(n, 1) * 10 + torch.arange(3),  # (n, 3)
            "score": rows.float() / 2,  # (n,)
        },
        non_tensors={
            "uid": [f"u{i}" for i in range(n)],
            "tokens": [list(range(i % 4)) for i in range(n)],  # lists of different lengths
        },
        meta_info={"step": 3, "temperature": 1.0} if meta is None else meta,
    )


def rows_of(data: DataProto) -> list[int]:
    """The original row indices held by `data` (recovered from the 'score' tensor)."""
    return [int(v * 2) for v in data.batch["score"].tolist()]


def assert_same(a: DataProto, b: DataProto) -> None:
    """Identical tensors, non-tensors and meta_info."""
    assert len(a) == len(b)
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        assert a.batch[key].dtype == b.batch[key].dtype
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        assert value.dtype == object and b.non_tensor_batch[key].dtype == object
        assert value.shape == b.non_tensor_batch[key].shape
        assert list(value) == list(b.non_tensor_batch[key]), key
    assert a.meta_info == b.meta_info


# ---------------------------------------------------------------------------------- construction


def test_from_dict_builds_tensors_non_tensors_and_meta():
    data = make_data(4)
    assert len(data) == 4
    assert data.batch.batch_size == torch.Size([4])
    assert data.batch["ids"].shape == (4, 3)
    assert data.non_tensor_batch["uid"].dtype == object
    assert list(data.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u3"]
    assert data.meta_info == {"step": 3, "temperature": 1.0}
    assert data.keys() == ["ids", "score", "uid", "tokens"]
    assert "ids" in data and "uid" in data and "missing" not in data


def test_from_single_dict_splits_by_type():
    data = DataProto.from_single_dict(
        {
            "x": torch.ones(3, 2),
            "y": torch.zeros(3),
            "uid": ["a", "b", "c"],
            "gt": np.array([1, 2, 3]),
        },
        meta_info={"k": "v"},
    )
    assert sorted(data.batch.keys()) == ["x", "y"]
    assert sorted(data.non_tensor_batch) == ["gt", "uid"]
    assert data.non_tensor_batch["gt"].dtype == object
    assert list(data.non_tensor_batch["gt"]) == [1, 2, 3]
    assert data.meta_info == {"k": "v"}
    assert len(data) == 3


def test_len_of_non_tensor_only_and_empty():
    assert len(DataProto.from_dict(non_tensors={"uid": ["a", "b"]})) == 2
    assert len(DataProto()) == 0


def test_tensor_batch_size_mismatch_names_keys_and_sizes():
    with pytest.raises(ValueError) as err:
        DataProto.from_dict({"a": torch.zeros(3, 2), "b": torch.zeros(4)})
    msg = str(err.value)
    assert "'a'" in msg and "'b'" in msg
    assert "3" in msg and "4" in msg


def test_tensor_vs_non_tensor_size_mismatch_names_keys_and_sizes():
    with pytest.raises(ValueError) as err:
        DataProto.from_dict({"a": torch.zeros(3)}, {"uid": ["x", "y"]})
    msg = str(err.value)
    assert "tensor 'a': 3" in msg
    assert "non-tensor 'uid': 2" in msg


def test_non_tensor_lists_of_different_lengths_stay_one_element_per_row():
    data = DataProto.from_dict(non_tensors={"toks": [[1], [1, 2], [1, 2, 3]]})
    arr = data.non_tensor_batch["toks"]
    assert arr.dtype == object and arr.shape == (3,)
    assert arr[2] == [1, 2, 3]
    # equal-length lists must not be turned into a 2-D array either
    same = DataProto.from_dict(non_tensors={"toks": [[1, 2], [3, 4]]})
    assert same.non_tensor_batch["toks"].shape == (2,)
    assert same.non_tensor_batch["toks"][1] == [3, 4]


# ---------------------------------------------------------------------------------- key operations


def test_select_keeps_only_named_keys():
    data = make_data(4)
    out = data.select(batch_keys=["ids"], non_tensor_batch_keys=["uid"], meta_info_keys=["step"])
    assert list(out.batch.keys()) == ["ids"]
    assert list(out.non_tensor_batch) == ["uid"]
    assert out.meta_info == {"step": 3}
    assert torch.equal(out.batch["ids"], data.batch["ids"])
    # the source is untouched
    assert sorted(data.keys()) == ["ids", "score", "tokens", "uid"]


def test_select_deepcopy_does_not_share_storage():
    data = make_data(4)
    out = data.select(batch_keys=["score"], deepcopy=True)
    out.batch["score"][0] = 100.0
    assert data.batch["score"][0] == 0.0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"batch_keys": ["nope"]}, "nope"),
        ({"non_tensor_batch_keys": ["missing_nt"]}, "missing_nt"),
        ({"meta_info_keys": ["missing_meta"]}, "missing_meta"),
    ],
)
def test_select_unknown_key_raises_key_error_naming_it(kwargs, name):
    with pytest.raises(KeyError, match=name):
        make_data(4).select(**kwargs)


def test_select_unknown_tensor_key_raises_without_tensor_batch():
    """A tensor key that is not there must fail even when the DataProto holds no tensors at all."""
    data = DataProto.from_dict(non_tensors={"uid": ["a", "b"]})
    with pytest.raises(KeyError, match="nope"):
        data.select(batch_keys=["nope"])


def test_pop_removes_from_source_and_returns_them():
    data = make_data(5)
    ids = data.batch["ids"].clone()
    popped = data.pop(batch_keys=["ids"], non_tensor_batch_keys=["uid"], meta_info_keys=["step"])
    assert list(popped.batch.keys()) == ["ids"]
    assert torch.equal(popped.batch["ids"], ids)
    assert list(popped.non_tensor_batch["uid"]) == [f"u{i}" for i in range(5)]
    assert popped.meta_info == {"step": 3}
    assert list(data.batch.keys()) == ["score"]
    assert list(data.non_tensor_batch) == ["tokens"]
    assert data.meta_info == {"temperature": 1.0}
    assert len(data) == 5 and len(popped) == 5


def test_pop_unknown_key_raises_and_leaves_source_intact():
    data = make_data(3)
    with pytest.raises(KeyError, match="nope"):
        data.pop(batch_keys=["ids", "nope"])
    assert sorted(data.batch.keys()) == ["ids", "score"]


def test_rename_tensor_keys():
    data = make_data(3)
    ids = data.batch["ids"].clone()
    out = data.rename("ids", "input_ids")
    assert out is data
    assert "ids" not in data.batch.keys()
    assert torch.equal(data.batch["input_ids"], ids)
    data.rename(["input_ids", "score"], ["a", "b"])
    assert sorted(data.batch.keys()) == ["a", "b"]


def test_union_adds_keys_and_accepts_identical_duplicates():
    data = make_data(4)
    other = DataProto.from_dict(
        {"extra": torch.ones(4), "score": data.batch["score"].clone()},
        {"gt": ["1", "2", "3", "4"], "uid": [f"u{i}" for i in range(4)]},
        {"new_meta": True, "step": 3},
    )
    out = data.union(other)
    assert out is data
    assert sorted(data.batch.keys()) == ["extra", "ids", "score"]
    assert torch.equal(data.batch["extra"], torch.ones(4))
    assert sorted(data.non_tensor_batch) == ["gt", "tokens", "uid"]
    assert list(data.non_tensor_batch["gt"]) == ["1", "2", "3", "4"]
    assert data.meta_info == {"step": 3, "temperature": 1.0, "new_meta": True}


def test_union_into_empty_takes_other():
    data = DataProto()
    data.union(make_data(3))
    assert_same(data, make_data(3))


def test_union_identical_non_tensor_rows_holding_numpy_arrays():
    """Identical duplicate keys are fine, also when each row is a numpy array (e.g. token ids)."""
    rows = [np.array([1, 2]), np.array([3])]
    a = DataProto.from_dict(non_tensors={"ids": rows})
    b = DataProto.from_dict(non_tensors={"ids": [r.copy() for r in rows]})
    a.union(b)
    assert len(a) == 2
    assert np.array_equal(a.non_tensor_batch["ids"][0], [1, 2])


def test_union_conflicting_tensor_key_raises_naming_it():
    data = make_data(4)
    other = DataProto.from_dict({"score": torch.full((4,), 9.0)})
    with pytest.raises(ValueError, match="tensor key 'score'"):
        data.union(other)


def test_union_conflicting_non_tensor_key_raises_naming_it():
    data = make_data(4)
    other = DataProto.from_dict(non_tensors={"uid": ["x", "y", "z", "w"]})
    with pytest.raises(ValueError, match="non-tensor key 'uid'"):
        data.union(other)


def test_union_conflicting_meta_key_raises_naming_it():
    data = make_data(4)
    other = DataProto.from_dict(meta_info={"step": 4})
    with pytest.raises(ValueError, match="meta_info key 'step'"):
        data.union(other)


def test_union_different_batch_sizes_raise():
    with pytest.raises(ValueError, match=r"4 vs 3"):
        make_data(4).union(DataProto.from_dict({"extra": torch.ones(3)}))


# ---------------------------------------------------------------------------------- row operations


def test_concat_three_parts_in_order():
    parts = [
        DataProto.from_dict(
            {"x": torch.tensor([[i, i]] * size)}, {"uid": [f"{i}-{j}" for j in range(size)]}, meta
        )
        for i, (size, meta) in enumerate([(2, {"a": 1}), (1, {"b": 2}), (3, {"a": 1, "c": 3})])
    ]
    out = DataProto.concat(parts)
    assert len(out) == 6
    assert out.batch["x"][:, 0].tolist() == [0, 0, 1, 2, 2, 2]
    assert list(out.non_tensor_batch["uid"]) == ["0-0", "0-1", "1-0", "2-0", "2-1", "2-2"]
    assert out.meta_info == {"a": 1, "b": 2, "c": 3}


def test_concat_mismatched_keys_raise():
    a = DataProto.from_dict({"x": torch.zeros(2)}, {"uid": ["a", "b"]})
    b = DataProto.from_dict({"y": torch.zeros(2)}, {"uid": ["c", "d"]})
    with pytest.raises(ValueError, match="keys"):
        DataProto.concat([a, b])
    c = DataProto.from_dict({"x": torch.zeros(2)}, {"other": ["c", "d"]})
    with pytest.raises(ValueError, match="keys"):
        DataProto.concat([a, c])


def test_concat_conflicting_meta_raises():
    a = DataProto.from_dict({"x": torch.zeros(1)}, meta_info={"step": 1})
    b = DataProto.from_dict({"x": torch.zeros(1)}, meta_info={"step": 2})
    with pytest.raises(ValueError, match="step"):
        DataProto.concat([a, b])


def test_concat_empty_list_raises():
    with pytest.raises(ValueError):
        DataProto.concat([])


def test_chunk_uneven_sizes_and_round_trip():
    data = make_data(10)
    chunks = data.chunk(3)
    assert [len(c) for c in chunks] == [4, 3, 3]
    assert rows_of(chunks[0]) == [0, 1, 2, 3]
    assert rows_of(chunks[2]) == [7, 8, 9]
    assert all(c.meta_info == data.meta_info for c in chunks)
    assert_same(DataProto.concat(chunks), data)


def test_split_int_with_remainder():
    data = make_data(10)
    parts = data.split(4)
    assert [len(p) for p in parts] == [4, 4, 2]
    assert rows_of(parts[2]) == [8, 9]
    assert list(parts[2].non_tensor_batch["uid"]) == ["u8", "u9"]
    assert_same(DataProto.concat(parts), data)


def test_split_list_of_sizes():
    data = make_data(10)
    parts = data.split([1, 6, 3])
    assert [len(p) for p in parts] == [1, 6, 3]
    assert rows_of(parts[1]) == [1, 2, 3, 4, 5, 6]
    assert_same(DataProto.concat(parts), data)


def test_split_list_not_summing_to_len_raises():
    with pytest.raises(ValueError, match="10"):
        make_data(10).split([3, 3, 3])


@pytest.mark.parametrize(
    "interleave, expected", [(True, [0, 0, 1, 1, 2, 2]), (False, [0, 1, 2] * 2)]
)
def test_repeat(interleave, expected):
    data = make_data(3)
    out = data.repeat(2, interleave=interleave)
    assert len(out) == 6
    assert rows_of(out) == expected
    assert out.batch["ids"][:, 0].tolist() == [10 * i for i in expected]
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in expected]
    assert list(out.non_tensor_batch["tokens"]) == [list(range(i % 4)) for i in expected]
    assert out.meta_info == data.meta_info


@pytest.mark.parametrize(
    "index",
    [
        [4, 0, 2],
        np.array([4, 0, 2]),
        torch.tensor([4, 0, 2]),
    ],
    ids=["list", "numpy", "torch"],
)
def test_index_select_sequences(index):
    out = make_data(6).index_select(index)
    assert rows_of(out) == [4, 0, 2]
    assert list(out.non_tensor_batch["uid"]) == ["u4", "u0", "u2"]
    assert list(out.non_tensor_batch["tokens"]) == [[], [], [0, 1]]


def test_index_select_slice_and_bool_mask():
    data = make_data(6)
    assert rows_of(data.index_select(slice(1, 5, 2))) == [1, 3]
    mask = np.array([True, False, False, True, True, False])
    out = data.index_select(mask)
    assert rows_of(out) == [0, 3, 4]
    assert list(out.non_tensor_batch["uid"]) == ["u0", "u3", "u4"]
    out_t = data.index_select(torch.tensor(mask))
    assert rows_of(out_t) == [0, 3, 4]
    # __getitem__ with non-int indices goes through index_select
    assert rows_of(data[1:3]) == [1, 2]
    assert rows_of(data[[5, 1]]) == [5, 1]


def test_index_select_errors():
    data = make_data(3)
    with pytest.raises(IndexError):
        data.index_select([0, 3])
    with pytest.raises(ValueError):
        data.index_select(np.array([True, False]))


def test_reorder_permutes_in_place():
    data = make_data(5)
    perm = torch.tensor([3, 1, 4, 0, 2])
    assert data.reorder(perm) is None
    assert rows_of(data) == [3, 1, 4, 0, 2]
    assert list(data.non_tensor_batch["uid"]) == ["u3", "u1", "u4", "u0", "u2"]
    assert data.batch["ids"][:, 1].tolist() == [31, 11, 41, 1, 21]


def test_getitem_int_returns_item():
    data = make_data(4)
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].tolist() == [20, 21, 22]
    assert item.batch["score"].item() == 1.0
    assert item.non_tensor_batch == {"uid": "u2", "tokens": [0, 1]}
    assert item.meta_info == data.meta_info
    assert data[-1].non_tensor_batch["uid"] == "u3"
    assert data[np.int64(1)].non_tensor_batch["uid"] == "u1"


# ---------------------------------------------------------------------------------- padding


@pytest.mark.parametrize("n, divisor, expected_pad", [(10, 4, 2), (5, 8, 3), (3, 7, 4), (1, 3, 2)])
def test_pad_to_divisor_and_unpad(n, divisor, expected_pad):
    data = make_data(n)
    padded, pad = data.pad_to_divisor(divisor)
    assert pad == expected_pad
    assert len(padded) % divisor == 0 and len(padded) == n + pad
    # pad rows are copies of the leading rows (cycling when pad > n)
    assert rows_of(padded)[n:] == [i % n for i in range(pad)]
    assert list(padded.non_tensor_batch["uid"][n:]) == [f"u{i % n}" for i in range(pad)]
    assert_same(padded.unpad(pad), data)
    assert_same(data, make_data(n))  # the source was not modified


def test_pad_to_divisor_already_divisible():
    data = make_data(8)
    padded, pad = data.pad_to_divisor(4)
    assert pad == 0
    assert_same(padded, data)
    assert_same(padded.unpad(0), data)


def test_pad_to_divisor_rejects_bad_input():
    with pytest.raises(ValueError):
        make_data(3).pad_to_divisor(0)
    with pytest.raises(ValueError):
        DataProto().pad_to_divisor(2)


# ---------------------------------------------------------------------------------- transport


def test_pickle_round_trip():
    data = make_data(6, meta={"step": 1, "nested": {"a": [1, 2]}, "t": torch.tensor([1.5])})
    out = pickle.loads(pickle.dumps(data))
    assert len(out) == 6
    for key in data.batch.keys():
        assert torch.equal(out.batch[key], data.batch[key])
    assert list(out.non_tensor_batch["tokens"]) == list(data.non_tensor_batch["tokens"])
    assert out.non_tensor_batch["tokens"].dtype == object
    assert out.meta_info["nested"] == {"a": [1, 2]}
    assert torch.equal(out.meta_info["t"], torch.tensor([1.5]))


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_put_get_round_trip(ray_cluster):
    data = make_data(7)
    out = ray.get(ray.put(data))
    assert isinstance(out, DataProto)
    assert_same(out, data)


def test_ray_remote_function_modifies_and_returns(ray_cluster):
    # Defined locally so Ray ships it by value (the test module is not importable on workers).
    @ray.remote
    def bump(batch: DataProto) -> DataProto:
        batch.batch["score"] = batch.batch["score"] + 100
        batch.non_tensor_batch["uid"] = np.array(
            [u + "!" for u in batch.non_tensor_batch["uid"]], dtype=object
        )
        batch.meta_info["visited"] = True
        return batch

    data = make_data(5)
    out = ray.get(bump.remote(data))
    assert isinstance(out, DataProto)
    assert torch.equal(out.batch["score"], data.batch["score"] + 100)
    assert torch.equal(out.batch["ids"], data.batch["ids"])
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}!" for i in range(5)]
    assert list(out.non_tensor_batch["tokens"]) == list(data.non_tensor_batch["tokens"])
    assert out.non_tensor_batch["tokens"].dtype == object
    assert out.meta_info == {"step": 3, "temperature": 1.0, "visited": True}
    # the driver's copy is unchanged
    assert "visited" not in data.meta_info
    assert rows_of(data) == [0, 1, 2, 3, 4]
