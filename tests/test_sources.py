"""Data sources as Flower apps have them (sky_flower.pipeline.sources): a DataLoader, a
map-style Dataset, a Hugging Face ``datasets.Dataset`` (a flwr_datasets partition) give
the data owner exactly the batches of the equivalent numpy Split; dict batches, padding
to the model's shapes, and the refusals (in-process, no engine)."""

import datasets
import numpy as np
import pytest
import torch
from flwr_datasets.partitioner import IidPartitioner
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from sky_flower.pipeline.data import Split
from sky_flower.pipeline.packing import pack_inputs
from sky_flower.pipeline.sources import (
    DatasetSource,
    ModelInputs,
    as_source,
    check_source,
    sample_rows,
)
from sky_flower.pipeline.stage import step_batch

datasets.disable_progress_bars()
N, SHAPE = 40, (3, 4, 4)


def _split(seed=0):
    rng = np.random.default_rng(seed)
    return Split(rng.random((N, *SHAPE), dtype=np.float32), rng.integers(0, 10, N))


class Pairs(Dataset):
    """A torchvision-style data set: ``(image tensor, int label)`` per index."""

    def __init__(self, split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitem__(self, i):
        return torch.from_numpy(self.split.x[i]), int(self.split.y[i])


def _hf(split):
    return datasets.Dataset.from_dict({"img": list(split.x), "label": split.y.tolist()})


def _as_tensor(batch):  # a with_transform: per batch, lazily
    batch["img"] = [torch.as_tensor(np.asarray(i, dtype=np.float32)) for i in batch["img"]]
    return batch


SOURCES = {
    "DataLoader(TensorDataset)": lambda s: DataLoader(
        TensorDataset(torch.from_numpy(s.x), torch.from_numpy(s.y)), batch_size=7, shuffle=True
    ),
    "map-style Dataset": Pairs,
    "DataLoader(Dataset)": lambda s: DataLoader(Pairs(s), batch_size=3),
    "datasets.Dataset": _hf,
    "datasets.Dataset.with_transform in a DataLoader": lambda s: DataLoader(
        _hf(s).with_transform(_as_tensor), batch_size=5
    ),
    "(trainloader, testloader)": lambda s: (DataLoader(Pairs(s)), DataLoader(Pairs(s))),
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_source_gives_the_splits_batches(kind):
    split = _split()
    source = as_source(SOURCES[kind](split))
    assert isinstance(source, DatasetSource) and len(source) == N
    for step in range(7):  # several epochs of the data owner's seeded order
        x, y = step_batch(source, 8, server_round=2, seed=3, step=step)
        ex, ey = step_batch(split, 8, server_round=2, seed=3, step=step)
        assert x.dtype == ex.dtype and torch.equal(x, ex), step
        assert torch.equal(y.long(), ey), step
    rows = np.array([9, 1, 30])
    part = source.subset(rows)
    assert len(part) == 3
    assert torch.equal(part.batch(np.array([2, 0]))[0], torch.from_numpy(split.x[[30, 9]]))


def test_a_flwr_datasets_partition_with_lazy_transform():
    split = _split()
    partitioner = IidPartitioner(num_partitions=4)
    partitioner.dataset = _hf(split)
    part = partitioner.load_partition(1)  # what a Flower app's load_data hands Sky
    calls = []

    def transform(batch):
        calls.append(len(batch["img"]))
        return _as_tensor(batch)

    source = as_source(DataLoader(part.with_transform(transform), batch_size=4))
    x, y = source.batch(np.array([0, 3]))
    assert calls == [2]  # the transform ran on the batch's rows only
    plain = [part[i] for i in (0, 3)]  # the partition's rows, read without the transform
    assert y.tolist() == [r["label"] for r in plain]
    want = torch.stack([torch.tensor(np.asarray(r["img"], dtype=np.float32)) for r in plain])
    assert torch.equal(x, want)


def _text_batches():
    """Dict batches as a tokenizer and a padding collator make them: lengths differ."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 7, N)
    rows = [
        {
            "input_ids": rng.integers(1, 50, n).tolist(),
            "attention_mask": [1] * int(n),
            "labels": int(rng.integers(0, 2)),
        }
        for n in lengths
    ]

    def pad_collate(batch):
        longest = max(len(b["input_ids"]) for b in batch)
        out = {k: [] for k in batch[0]}
        for b in batch:
            pad = longest - len(b["input_ids"])
            out["input_ids"].append(b["input_ids"] + [0] * pad)
            out["attention_mask"].append(b["attention_mask"] + [0] * pad)
            out["labels"].append(b["labels"])
        return {k: torch.tensor(v) for k, v in out.items()}

    return rows, pad_collate


def test_dict_batches_pack_the_named_inputs_padded_to_the_models_shape():
    rows, collate = _text_batches()
    loader = DataLoader(rows, batch_size=4, collate_fn=collate)
    source = as_source(loader, input_keys=["input_ids", "attention_mask"], label_key="labels")
    pick = np.array([0, 5, 2])
    x, y = as_source(loader, ["input_ids", "attention_mask"], "labels").batch(pick)
    raw = collate([rows[i] for i in pick])
    assert torch.equal(x, pack_inputs([raw["input_ids"], raw["attention_mask"]]))
    assert torch.equal(y, raw["labels"])
    # a converted model of a fixed length 8: padded with zeros on the right (mask 0)
    source = as_source(loader, ["input_ids", "attention_mask"], "labels", ModelInputs(((8,), (8,))))
    x, _ = source.batch(pick)
    ids, mask = x[:, :8], x[:, 8:]
    n = raw["input_ids"].shape[1]
    assert torch.equal(ids[:, :n], raw["input_ids"]) and not ids[:, n:].any()
    assert torch.equal(mask[:, :n], raw["attention_mask"]) and not mask[:, n:].any()
    with pytest.raises(ValueError, match=r"truncate them to \[3\].*max_length=3"):
        as_source(
            loader, ["input_ids", "attention_mask"], "labels", ModelInputs(((3,), (3,)))
        ).batch(pick)


def test_token_labels_are_padded_with_the_ignore_index():
    rows, collate = _text_batches()

    def lm_collate(batch):
        out = collate(batch)
        return {"input_ids": out["input_ids"], "labels": out["input_ids"].clone()}

    source = as_source(DataLoader(rows, collate_fn=lm_collate), model_inputs=ModelInputs(((9,),)))
    x, y = source.batch(np.array([1, 2]))
    n = lm_collate([rows[1], rows[2]])["input_ids"].shape[1]
    assert x.shape == (2, 9) and y.shape == (2, 9)
    assert (y[:, n:] == -100).all() and torch.equal(y[:, :n], x[:, :n])


def test_several_inputs_need_input_keys_and_missing_keys_are_named():
    rows, collate = _text_batches()
    loader = DataLoader(rows, collate_fn=collate)
    with pytest.raises(ValueError, match=r"input_keys=\['input_ids', 'attention_mask'\]"):
        as_source(loader).batch(np.array([0, 1]))
    with pytest.raises(ValueError, match=r"label_key='target' is not in .*'labels'"):
        as_source(loader, "input_ids", "target").batch(np.array([0, 1]))
    with pytest.raises(ValueError, match=r"\['token_type_ids'\] are not in"):
        as_source(loader, ["input_ids", "token_type_ids"]).batch(np.array([0, 1]))


def test_refusals_name_what_to_give_instead():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ValueError, match="IterableDataset cannot be read by rows"):
        as_source(Stream())
    with pytest.raises(ValueError, match="DataLoader over an IterableDataset"):
        as_source(DataLoader(Stream()))
    hf = _hf(_split())
    with pytest.raises(ValueError, match=r"DatasetDict.*give one split"):
        as_source(hf.train_test_split(test_size=0.5))
    with pytest.raises(ValueError, match="streaming"):
        as_source(hf.to_iterable_dataset())
    with pytest.raises(ValueError, match="load_data returned int"):
        as_source(3)
    strings = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    with pytest.raises(ValueError, match=r"holds 'text' as text: tokenize it"):
        as_source(strings, "text").batch(np.array([0, 1]))


def test_check_source_samples_a_large_source_and_finds_nan_in_the_sample():
    split = _split()
    split.x[17, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match=r"partition 0 of 1 has non-finite inputs .* 1 of 40"):
        check_source(as_source(Pairs(split)), "partition 0 of 1")
    rows = sample_rows(10_000)
    assert len(rows) == 256 and list(rows[:2]) == [0, 1] and len(set(rows)) == 256
    assert np.array_equal(rows, sample_rows(10_000))  # seeded
    with pytest.raises(ValueError, match="holds no samples"):
        check_source(as_source(Pairs(Split(split.x[:0], split.y[:0]))), "partition 3 of 4")


def digits_as_datasets(test_fraction: float, seed: int):
    """A Hydra ``dataset._target_`` returning Hugging Face data sets (x, y) instead of
    Splits: the same rows as the digits loader."""
    from sky_flower.pipeline.data import load_digits

    train, test = load_digits(test_fraction, seed)
    return tuple(
        datasets.Dataset.from_dict({"x": list(s.x), "label": s.y.tolist()}) for s in (train, test)
    )


def digits_as_loaders(test_fraction: float, seed: int):
    """A Hydra ``dataset._target_`` returning DataLoaders over TensorDatasets."""
    from sky_flower.pipeline.data import load_digits

    return tuple(
        DataLoader(TensorDataset(torch.from_numpy(s.x), torch.from_numpy(s.y)), batch_size=9)
        for s in load_digits(test_fraction, seed)
    )


@pytest.mark.parametrize("loader", ["digits_as_datasets", "digits_as_loaders"])
def test_a_hydra_dataset_may_return_sources(loader):
    """``dataset._target_`` returning a datasets.Dataset / DataLoader per split: the job's
    checks run on a sample, each owner's partition gives the digits Split's batches, and
    the server-side evaluation equals the Split's."""
    from sky_flower.app import hydra_parts
    from sky_flower.jobs.sky import evaluate_fn_for
    from sky_flower.pipeline.data import load_dataset, owner_partition

    digits = hydra_parts()
    parts = hydra_parts(["~dataset", f"+dataset._target_=test_sources.{loader}"])
    assert parts.input_shape == digits.input_shape == [64]
    for owner in range(2):
        mine, theirs = parts.load_data(owner, 2), digits.load_data(owner, 2)
        assert len(mine) == len(theirs)
        for step in range(3):
            x, y = step_batch(mine, 32, 1, 0, step)
            ex, ey = step_batch(theirs, 32, 1, 0, step)
            assert torch.equal(x, ex) and torch.equal(y, ey)
    from flwr.app import ArrayRecord

    arrays = ArrayRecord(digits.model_fn().state_dict())
    got = evaluate_fn_for(parts.model_fn, parts.test, chunk=100)(0, arrays)
    want = evaluate_fn_for(digits.model_fn, digits.test, chunk=100)(0, arrays)
    assert dict(got) == dict(want)
    train, _ = load_dataset({"_target_": f"test_sources.{loader}"})
    assert len(owner_partition(train, 0, 3)) == len(owner_partition(digits_split(), 0, 3))


def digits_split():
    from sky_flower.pipeline.data import load_digits

    return load_digits(0.2, 0)[0]


def test_a_hydra_dataset_of_another_kind_is_refused_naming_the_split():
    from sky_flower.pipeline.data import load_dataset

    with pytest.raises(
        ValueError, match=r"its train split must be a Split.*load_data returned int"
    ):
        load_dataset({"_target_": "test_sources.bad_loader"})


def bad_loader(test_fraction: float, seed: int):
    return 3, 4


def test_an_input_of_the_wrong_kind_of_dtype_is_refused_naming_it():
    images = np.random.default_rng(0).integers(0, 255, (6, 3, 4, 4)).astype(np.uint8)
    rows = [{"img": torch.from_numpy(a), "label": 1} for a in images]
    source = as_source(rows, model_inputs=ModelInputs(((3, 4, 4),), ("float32",)))
    with pytest.raises(ValueError, match=r"'img' is uint8 but the model takes float32"):
        source.batch(np.array([0, 1]))
    ok = as_source(rows, model_inputs=ModelInputs(((3, 4, 4),), ("uint8",)))
    assert ok.batch(np.array([0, 1]))[0].dtype == torch.uint8


def test_input_keys_follow_the_models_names_and_a_wrong_order_is_refused():
    rows, collate = _text_batches()
    loader = DataLoader(rows, collate_fn=collate)
    takes = ModelInputs(((8,), (8,)), ("int64", "int64"), ("input_ids", "attention_mask"))
    x, _ = as_source(loader, model_inputs=takes).batch(np.array([0, 1]))  # no input_keys
    want, _ = as_source(loader, ["input_ids", "attention_mask"], model_inputs=takes).batch(
        np.array([0, 1])
    )
    assert torch.equal(x, want)
    swapped = as_source(loader, ["attention_mask", "input_ids"], model_inputs=takes)
    with pytest.raises(ValueError, match=r"but the model takes \['input_ids', 'attention_mask'\]"):
        swapped.batch(np.array([0, 1]))


def test_tuples_numpy_pairs_and_datasets_with_x_y_attributes():
    split = _split()
    pair = as_source((split.x, split.y))  # numpy's (X, y)
    assert torch.equal(pair.batch(np.array([3]))[0], torch.from_numpy(split.x[[3]]))
    with pytest.raises(ValueError, match="a tuple of 3 items"):
        as_source((Pairs(split), Pairs(split), Pairs(split)))

    class Shifted(Pairs):  # x, y attributes, but __getitem__ is what the app trains on
        def __init__(self, split):
            super().__init__(split)
            self.x, self.y = split.x, split.y + 1

        def __getitem__(self, i):
            return torch.from_numpy(self.x[i]) * 2, int(self.y[i]) - 1

    x, y = as_source(Shifted(split)).batch(np.array([0, 5]))
    assert torch.equal(x, 2 * torch.from_numpy(split.x[[0, 5]]))
    assert y.tolist() == split.y[[0, 5]].tolist()


def test_ragged_samples_without_a_collator_are_refused_naming_the_fix():
    rows = [{"input_ids": torch.arange(n), "label": 0} for n in (3, 4, 5)]
    with pytest.raises(ValueError, match="different shapes .*DataCollatorWithPadding"):
        as_source(rows).batch(np.array([0, 1]))


def test_a_batch_with_nan_outside_the_checked_sample_is_refused_naming_its_rows():
    split = _split()
    split.x[17, 0, 0, 0] = np.inf
    source = as_source(Pairs(split))
    steps = [s for s in range(8) if 17 in _rows_of(s)]
    with pytest.raises(ValueError, match=r"non-finite inputs .* 1 of its 8 samples \(rows \[17\]"):
        step_batch(source, 8, server_round=1, seed=0, step=steps[0])


def _rows_of(step):
    from sky_flower.pipeline.data import batch_indices

    per_epoch = N // 8
    return set(batch_indices(N, 8, 1000 + step // per_epoch, 0)[step % per_epoch].tolist())


def test_a_dataloaders_own_sampler_is_named_as_unused():
    from torch.utils.data import WeightedRandomSampler

    split = _split()
    sampler = WeightedRandomSampler([1.0] * N, num_samples=N)
    with pytest.warns(UserWarning, match="WeightedRandomSampler.*is not used"):
        as_source(DataLoader(Pairs(split), sampler=sampler))


def test_float64_features_against_a_float32_model_are_refused_up_front():
    split = _split()
    wide = Split(split.x.astype(np.float64), split.y)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10))
    with pytest.raises(ValueError, match=r"float64 inputs but the model's parameters are float32"):
        check_source(wide, "partition 0 of 1", model=model)
    with pytest.raises(ValueError, match=r"float64 inputs"):
        check_source(as_source(Pairs(wide)), "partition 0 of 1", model=model)
    check_source(split, "partition 0 of 1", model=model)  # float32: fine


def test_integer_pixels_against_a_float_model_are_refused_up_front_with_the_fix():
    """uint8 images (a data set without ToTensor) into a float32 model: named with the
    conversion to write, on the data owner before any step (it was torch's raw "mat1
    and mat2 must have the same dtype")."""
    from sky_flower.pipeline.sources import check_labels

    split = _split()
    pixels = Split((split.x * 255).clip(0, 255).astype(np.uint8), split.y)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10))
    ce = torch.nn.functional.cross_entropy
    probe = check_source(as_source(Pairs(pixels)), "p", model=model)
    with pytest.raises(ValueError, match=r"partition 0 of 1's samples .*uint8.*x\.float\(\) / 255"):
        check_labels(probe, model, ce, "partition 0 of 1")


def test_labels_outside_the_models_outputs_are_refused_on_the_data_owner():
    from sky_flower.pipeline.sources import check_labels

    split = _split()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10))
    ce = torch.nn.functional.cross_entropy
    check_labels(check_source(as_source(Pairs(split)), "p"), model, ce, "partition 0 of 1")
    shifted = Split(split.x, split.y + 1)  # 1-based labels: 10 is out of the 10 outputs
    shifted.y[5] = 10
    with pytest.raises(ValueError, match=r"labels in \[1, 10\].*outputs 10 values"):
        check_labels(check_source(as_source(Pairs(shifted)), "p"), model, ce, "partition 0 of 1")


def test_an_owner_with_fewer_samples_than_a_batch_is_told_the_batch_size_to_give():
    from sky_flower.pipeline.stage import step_batch

    small = Split(_split().x[:5], _split().y[:5])
    with pytest.raises(ValueError, match=r"holds 5 examples, fewer than a batch of 8.*at most 5"):
        step_batch(small, 8, 1, 0, 0)


def test_a_loss_that_does_not_reduce_as_declared_is_refused_on_the_data_owner():
    """Labels padded with -100 make cross-entropy a mean over the labelled samples: under
    the default loss-reduction=mean each micro-batch would be scaled by 1 / M, not by its
    labelled count, and split training would silently differ from unsplit. A Flower
    app's owner checks the declared reduction on its sample (the Hydra job did, the app
    path did not)."""
    from sky_flower.pipeline.lm import token_count
    from sky_flower.pipeline.objective import LossReduction
    from sky_flower.pipeline.sources import check_labels

    split = _split()
    padded = Split(split.x, split.y.copy())
    padded.y[0] = -100  # the first sample's label is padding
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10))
    ce = torch.nn.functional.cross_entropy
    probe = check_source(as_source(Pairs(padded)), "p")
    with pytest.raises(ValueError, match=r"partition 0 of 1: .*loss-reduction=mean.*weighted"):
        check_labels(probe, model, ce, "partition 0 of 1", LossReduction())
    check_labels(probe, model, ce, "partition 0 of 1", LossReduction("weighted", token_count))
    check_labels(check_source(split, "p"), model, ce, "partition 0 of 1", LossReduction())
