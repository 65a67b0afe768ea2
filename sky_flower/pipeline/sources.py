"""A data owner's partition as Flower apps have it: a map-style PyTorch ``Dataset``, a
``DataLoader``, a Hugging Face ``datasets.Dataset`` (a ``flwr_datasets`` partition), or
the numpy :class:`Split`; all are read the same way, one batch of rows at a time.

Sky's schedule decides every batch (its size and which rows, seeded:
:func:`sky_flower.pipeline.data.batch_indices`), so a ``DataLoader`` given here lends
only its ``dataset`` and its ``collate_fn``; its ``batch_size``, ``shuffle`` and
``sampler`` are not used. The rows of a batch are fetched and collated exactly as a
``DataLoader`` fetches them (``dataset.__getitems__(rows)`` where the data set has it,
else ``dataset[i]`` per row, then ``collate_fn``): the transforms a data set applies
(``datasets.Dataset.with_transform``, a torchvision transform in ``__getitem__``) run
per batch, on the batch's rows only, and nothing is read whole.

A collated batch becomes the pipeline's ``(x, labels)``:

- a ``(inputs, labels)`` pair (a torchvision-style data set);
- a mapping (``batch["img"]``, ``batch["label"]``; a tokenizer's ``input_ids``,
  ``attention_mask`` and ``labels``): ``label_key`` names the labels (default: the
  one of ``label`` / ``labels`` present) and ``input_keys`` the model's inputs, in the
  order of its ``forward`` (default: the one other key). Several inputs are packed
  into one tensor (:func:`sky_flower.pipeline.packing.pack_inputs`), the form a model
  converted with ``sequential_of(..., inputs=[...])`` takes.

A model converted by :func:`sky_flower.pipeline.graph.sequential_of` has fixed sample
shapes and dtypes (:class:`ModelInputs`); an input of another kind of dtype is refused,
and a batch padded to its own longest sequence (Hugging
Face's ``DataCollatorWithPadding``) is padded on the right with zeros up to them (an
attention mask's zeros hide the padding), and labels of a batch's sequence length with
``-100`` (PyTorch's ignore index). A batch longer than the model's shape is refused,
naming the input: truncate it in the tokenizer (``max_length``).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own alias
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    default_collate,
)

#: Label keys looked for in a dict batch when ``label_key`` is not given.
LABEL_KEYS = ("label", "labels")
#: Rows the up-front checks read from a data source that is not in memory: the first two
#: and a seeded sample of the rest (:func:`sample_rows`).
CHECK_ROWS = 256


@dataclass(frozen=True)
class Split:
    """Inputs ``x`` (``(n, *input_shape)``; digits: float32 ``(n, 64)`` in [0, 1]) and
    labels ``y`` (``(n, ...)``; class indices int64 for classification, float32 for a
    regression target, int64 ``(n, seq_len)`` token ids for a language model)."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, labels)`` of samples ``rows`` (int ``(B,)``) as tensors (shared with
        the arrays' copies ``x[rows]``, ``y[rows]``)."""
        return torch.from_numpy(self.x[rows]), torch.from_numpy(self.y[rows])

    def subset(self, rows: np.ndarray) -> Split:
        """Samples ``rows`` only."""
        return Split(self.x[rows], self.y[rows])


@dataclass(frozen=True)
class ModelInputs:
    """What a model takes per sample: each input's shape (without the batch dimension)
    and, where known, its dtype (``"float32"``, ``"int64"``), in ``forward``'s order."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...] | None = None
    names: tuple[str, ...] | None = None  # the batch keys it takes (hf_model_fn's)

    @classmethod
    def of(cls, model: Any) -> ModelInputs | None:  # noqa: ANN401 - an nn.Module
        """A converted model's (:func:`sky_flower.pipeline.graph.sequential_of`:
        ``input_shapes``, ``input_dtypes``), else None (an ``nn.Sequential`` of your own
        takes the data's shape as it is)."""
        shapes = getattr(model, "input_shapes", None)
        if shapes is None:
            return None
        dtypes = getattr(model, "input_dtypes", None)
        names = getattr(model, "input_names", None)
        return cls(
            tuple(tuple(int(d) for d in s) for s in shapes),
            dtypes and tuple(dtypes),
            names and tuple(names),
        )


@runtime_checkable
class DataSource(Protocol):
    """What a data owner trains on: ``len(source)`` samples, read by rows."""

    def __len__(self) -> int: ...

    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, labels)`` of samples ``rows`` (int ``(B,)``), batch dimension first."""
        ...

    def subset(self, rows: np.ndarray) -> DataSource:
        """The source of samples ``rows`` only (a partition of it)."""
        ...


class DatasetSource:
    """A map-style ``Dataset`` (a ``datasets.Dataset`` included) read in batches of rows
    as a ``DataLoader`` reads it.

    Parameters
    ----------
    dataset : torch.utils.data.Dataset
        Map-style: ``len(dataset)`` and ``dataset[i]`` (or ``__getitems__``).
    collate_fn : callable, optional
        ``list of samples -> batch`` (default ``torch.utils.data.default_collate``).
    input_keys : str or sequence of str, optional
        Dict batches: the model's inputs, in ``forward``'s order.
    label_key : str, optional
        Dict batches: the labels.
    model_inputs : ModelInputs, optional
        What the model takes (:meth:`ModelInputs.of` a converted model): shorter inputs
        are padded up to its shapes, and an input of another shape or kind of dtype is
        refused by name.
    """

    def __init__(
        self,
        dataset: Any,  # noqa: ANN401 - any map-style data set
        collate_fn: Callable[[list], Any] | None = None,
        input_keys: str | Sequence[str] | None = None,
        label_key: str | None = None,
        model_inputs: ModelInputs | None = None,
    ) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self.input_keys = [input_keys] if isinstance(input_keys, str) else input_keys
        self.label_key = label_key
        self._model = model_inputs

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return f"DatasetSource({type(self.dataset).__name__}, {len(self)} samples)"

    def subset(self, rows: np.ndarray) -> DatasetSource:
        """Samples ``rows`` as a source read the same way (``torch.utils.data.Subset``;
        a ``datasets.Dataset`` selects them itself, keeping its transform)."""
        idx = [int(i) for i in rows]
        hf = _is_hf_dataset(self.dataset)
        data = self.dataset.select(idx) if hf else Subset(self.dataset, idx)
        return DatasetSource(data, self.collate_fn, self.input_keys, self.label_key, self._model)

    def raw_batch(self, rows: np.ndarray) -> Any:  # noqa: ANN401 - whatever collate_fn makes
        """Samples ``rows`` fetched and collated by a ``DataLoader`` (one batch, in the
        order of ``rows``, in this process)."""
        loader = DataLoader(
            self.dataset, batch_sampler=[[int(i) for i in rows]], collate_fn=self.collate_fn
        )
        try:
            return next(iter(loader))
        except RuntimeError as err:
            if "stack expects each tensor to be equal size" not in str(err):
                raise
            raise ValueError(
                f"the data set's samples have different shapes ({err}): pad them to one "
                "length in a DataLoader's collate_fn (a tokenizer's DataCollatorWithPadding) "
                "or in the data set's transform"
            ) from err

    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, labels)`` of samples ``rows`` (int ``(B,)``): ``x`` ``(B, *input_shape)``
        (several inputs packed: ``(B, n)``), ``labels`` ``(B, ...)``.

        Raises
        ------
        ValueError
            On a batch that is neither a pair nor a mapping, a label or input key it does
            not hold (naming the keys it holds), a value that is not a tensor, or an
            input longer than the model's shape.
        """
        inputs, labels, names = self.split_batch(self.raw_batch(rows))
        if self._model is not None:
            inputs, labels = fit_inputs(inputs, labels, self._model, names)
        if len(inputs) == 1:
            return inputs[0], labels
        from sky_flower.pipeline.packing import pack_inputs

        return pack_inputs(inputs), labels

    def split_batch(self, batch: Any) -> tuple[list[torch.Tensor], torch.Tensor, list[str]]:  # noqa: ANN401
        """A collated batch as ``([inputs...], labels, [the inputs' names])``.

        Raises
        ------
        ValueError
            As :meth:`batch`.
        """
        if isinstance(batch, Mapping):
            label_key = self.label_key or _default_label_key(batch)
            if label_key not in batch:
                raise ValueError(
                    f"label_key={label_key!r} is not in the data set's batches, whose keys "
                    f"are {sorted(batch)}: give the labels' key as label_key "
                    "(register_sky_client(app, model_fn, load_data, label_key=...), or "
                    "as_source(data, label_key=...))"
                )
            model_names = list(self._model.names or []) if self._model else []
            if self.input_keys and model_names and list(self.input_keys) != model_names:
                raise ValueError(
                    f"input_keys={list(self.input_keys)} but the model takes {model_names}, "
                    "in that order: give input_keys in the model's order"
                )
            if self.input_keys:
                keys = list(self.input_keys)
            elif model_names and all(k in batch for k in model_names):
                keys = model_names  # the batch keys the model is called with
            else:
                keys = [k for k in batch if k != label_key]
            missing = [k for k in keys if k not in batch]
            if missing or len(keys) != 1 and not (self.input_keys or model_names):
                what = f"input_keys {missing} are not" if missing else "several inputs are"
                raise ValueError(
                    f"{what} in the data set's batches, whose keys are {sorted(batch)} "
                    f"(labels: {label_key!r}): give the model's inputs in the order its "
                    f"forward takes them, e.g. input_keys={[k for k in batch if k != label_key]}"
                )
            inputs, labels = [batch[k] for k in keys], batch[label_key]
            names = list(keys) + [label_key]
        elif isinstance(batch, tuple | list) and len(batch) == 2:
            inputs, labels = [batch[0]], batch[1]
            names = ["inputs", "labels"]  # a pair's
        else:
            raise ValueError(
                f"the data set's batches are {type(batch).__name__}"
                + (f" of {len(batch)} items" if isinstance(batch, tuple | list) else "")
                + ": give (inputs, labels) pairs or dicts (name the keys with input_keys and "
                "label_key)"
            )
        for name, value in zip(names, [*inputs, labels], strict=True):
            if isinstance(value, list | tuple) and value and isinstance(value[0], str):
                raise ValueError(
                    f"the data set's batch holds {name!r} as text: tokenize it in the data "
                    "set (datasets.Dataset.map with a tokenizer) and name the token columns "
                    "as input_keys"
                )
            if not torch.is_tensor(value):
                raise ValueError(
                    f"the data set's batch holds {name!r} as {type(value).__name__}, not a "
                    "tensor: turn it into one in the data set's transform or collate_fn "
                    "(e.g. datasets.Dataset.with_format('torch'), torchvision's ToTensor, "
                    "a padding collator for sequences of different lengths)"
                )
        return list(inputs), labels, names[:-1]


def _default_label_key(batch: Mapping) -> str:
    found = [k for k in LABEL_KEYS if k in batch]
    return found[0] if len(found) == 1 else "label"


def fit_inputs(
    inputs: list[torch.Tensor],
    labels: torch.Tensor,
    model: ModelInputs,
    names: Sequence[str],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Pad each input ``(B, *s)`` on the right with zeros up to ``(B,
    *model.shapes[i])``, and integer labels ``(B, L)`` whose ``L`` is the first input's
    length (token labels) with ``-100``; float labels (multi-label targets) stay as
    they are.

    Raises
    ------
    ValueError
        On a count of inputs other than the model's, an input of another rank or longer
        than its shape (naming it and the model's shape), or of integer dtype where the
        model takes floats or the other way round (an image left as ``uint8``).
    """
    shapes = model.shapes
    for i, (t, name) in enumerate(zip(inputs, names, strict=False)):
        want = model.dtypes[i] if model.dtypes and i < len(model.dtypes) else None
        if want is None or t.dtype.is_floating_point == want.startswith(("float", "bfloat")):
            continue
        raise ValueError(
            f"the data set's {name!r} is {str(t.dtype).removeprefix('torch.')} but the model "
            f"takes {want}: convert it in the data set's transform or collate_fn "
            "(images: to float, e.g. torchvision's ToTensor; token ids: to int64)"
        )
    if len(inputs) != len(shapes):
        raise ValueError(
            f"the model takes {len(shapes)} input(s) but the data set gives {len(inputs)} "
            f"({list(names)}): name the model's inputs with input_keys"
        )
    out = []
    for t, shape, name in zip(inputs, shapes, names, strict=True):
        have, want = tuple(t.shape[1:]), tuple(int(d) for d in shape)
        if have == want:
            out.append(t)
            continue
        if len(have) != len(want) or any(h > w for h, w in zip(have, want, strict=True)):
            raise ValueError(
                f"the data set's {name!r} has samples of shape {list(have)} but the model "
                f"takes {list(want)}: "
                + (
                    f"truncate them to {list(want)} (a tokenizer's max_length={want[-1]}, "
                    "truncation=True) or convert the model for the longer shape"
                    if len(have) == len(want)
                    else "reshape them in the data set's transform"
                )
            )
        pad: list[int] = []
        for h, w in zip(reversed(have), reversed(want), strict=True):
            pad += [0, w - h]
        out.append(F.pad(t, pad))
    first_have = tuple(inputs[0].shape[1:])
    first_want = tuple(out[0].shape[1:])
    token_labels = labels.dim() == 2 and not labels.dtype.is_floating_point
    if token_labels and first_have != first_want and labels.shape[1] == first_have[-1]:
        labels = F.pad(labels, [0, first_want[-1] - first_have[-1]], value=-100)
    return out, labels


def _is_hf_dataset(obj: object) -> bool:
    """A Hugging Face ``datasets.Dataset`` (checked only where ``datasets`` is loaded)."""
    ds = sys.modules.get("datasets")
    return ds is not None and isinstance(obj, ds.Dataset)


def _refuse_hf_kinds(obj: object) -> None:
    ds = sys.modules.get("datasets")
    if ds is None:
        return
    if isinstance(obj, ds.DatasetDict):
        raise ValueError(
            f"a DatasetDict with splits {sorted(obj)} is not one partition: give one split "
            "(e.g. partition['train'])"
        )
    if isinstance(obj, ds.IterableDataset | ds.IterableDatasetDict):
        raise ValueError(
            "a streaming datasets.IterableDataset cannot be read by rows, and Sky's schedule "
            "draws each step's rows itself (seeded, the same on every run): load it without "
            "streaming=True, or give a map-style torch Dataset"
        )


def as_source(
    data: Any,  # noqa: ANN401 - any of the kinds in the module docstring
    input_keys: str | Sequence[str] | None = None,
    label_key: str | None = None,
    model_inputs: ModelInputs | None = None,
) -> Any:  # noqa: ANN401 - a Split or a DatasetSource
    """The data owner's partition ``data`` as a :class:`DataSource`.

    Parameters
    ----------
    data
        A :class:`Split` (returned as it is; any object
        with arrays ``x`` and ``y`` of one length is read as one); a
        ``DataLoader`` (its ``dataset`` and ``collate_fn``); a map-style ``Dataset`` or
        ``datasets.Dataset`` (a ``flwr_datasets`` partition); or a Flower app's
        ``load_data`` result ``(trainloader, testloader)``, whose first item is used.
    input_keys, label_key, model_inputs
        As :class:`DatasetSource`.

    Raises
    ------
    ValueError
        On an iterable-style (streaming) data set, a ``DatasetDict`` or a type that is
        none of the above, naming what to give instead.
    """
    if isinstance(data, tuple) and _arrays(data):
        if len(data) == 2 and len(data[0]) == len(data[1]):
            return Split(np.asarray(data[0]), np.asarray(data[1]))  # numpy's (X, y)
        raise ValueError(
            f"load_data returned a tuple of {len(data)} arrays of lengths "
            f"{[len(a) for a in data]}: give (x, y) of one length, or a Split"
        )
    if isinstance(data, tuple):
        if len(data) != 2:
            raise ValueError(
                f"load_data returned a tuple of {len(data)} items: give the training data "
                "alone or a (trainloader, testloader) pair, whose first Sky trains on"
            )
        data = data[0]  # (trainloader, testloader): train on the first
    if isinstance(data, Split | DatasetSource):
        return data
    x, y = getattr(data, "x", None), getattr(data, "y", None)
    readable = isinstance(data, Dataset | DataLoader) or _is_hf_dataset(data)
    if not readable and hasattr(x, "shape") and hasattr(y, "shape") and len(x) == len(y):
        # an app's own (x, y) holder; a Dataset with x, y attributes is read through its
        # __getitem__ (its transforms), as a DataLoader reads it
        return Split(np.asarray(x), np.asarray(y))
    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            raise ValueError(
                "a DataLoader over an IterableDataset cannot be read by rows, and Sky's "
                "schedule draws each step's rows itself (seeded): give a map-style Dataset"
            )
        if not isinstance(data.sampler, SequentialSampler | RandomSampler):
            warnings.warn(
                f"the DataLoader's sampler ({type(data.sampler).__name__}) is not used: Sky "
                "draws each step's rows itself (uniformly, seeded); weight or filter the "
                "samples in the data set instead",
                UserWarning,
                stacklevel=2,
            )
        if data.collate_fn is not default_collate:  # the app's own (a padding collator)
            return DatasetSource(data.dataset, data.collate_fn, input_keys, label_key, model_inputs)
        data = data.dataset
    _refuse_hf_kinds(data)
    if isinstance(data, IterableDataset):
        raise ValueError(
            "an IterableDataset cannot be read by rows, and Sky's schedule draws each "
            "step's rows itself (seeded): give a map-style Dataset (len and __getitem__)"
        )
    if _is_hf_dataset(data) and data.format["type"] is None:
        data = data.with_format("torch")  # python lists -> tensors, as a DataLoader needs
    if isinstance(data, Dataset) or _is_hf_dataset(data):
        return DatasetSource(data, None, input_keys, label_key, model_inputs)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and not _arrays([data]):
        return DatasetSource(data, None, input_keys, label_key, model_inputs)
    raise ValueError(
        f"load_data returned {type(data).__name__}: give a Split (numpy x, y), a map-style "
        "torch Dataset, a DataLoader, a datasets.Dataset (a flwr_datasets partition) or a "
        "(trainloader, testloader) pair"
    )


def _arrays(items: Sequence) -> bool:
    return all(isinstance(i, np.ndarray) or torch.is_tensor(i) for i in items)


def sample_rows(n: int, k: int = CHECK_ROWS, seed: int = 0) -> np.ndarray:
    """The rows the up-front checks read from a source of ``n`` samples: the first two
    and a seeded random ``k - 2`` of the rest (all rows when ``n <= k``), sorted."""
    if n <= k:
        return np.arange(n)
    rest = np.random.default_rng(seed).choice(np.arange(2, n), size=k - 2, replace=False)
    return np.concatenate([[0, 1], np.sort(rest)])


def check_source(
    source: Any,  # noqa: ANN401 - a source
    what: str,
    seed: int = 0,
    model: torch.nn.Module | None = None,
) -> Split:
    """Refuse a data owner's partition that cannot train, before any step runs: it must
    hold a sample, read into ``(x, labels)`` tensors (keys, types, shapes:
    :meth:`DatasetSource.batch`), hold no ``NaN`` / ``inf``, and (given the ``model``)
    hold float inputs of the float dtype of the model's parameters (numpy's default
    float64 against a float32 model fails mid-round otherwise).

    A :class:`Split` (in memory) is checked whole; any other
    source on the rows of :func:`sample_rows` only (the first two and a seeded
    ``CHECK_ROWS - 2`` of the rest), so a data set larger than memory is not read
    whole: a non-finite value outside the sample is not seen here.

    Returns
    -------
    Split
        What was checked (the source itself, or its sample): :func:`check_labels`'s
        probe, so the sample is read once.

    Raises
    ------
    ValueError
        Naming ``what`` (the partition), the rows read and what is wrong.
    """
    from sky_flower.pipeline.inputs import check_finite_data

    if len(source) < 1:
        raise ValueError(f"{what} holds no samples: a data owner needs at least one batch")
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()] if model else []
    if isinstance(source, Split):
        check_finite_data(source, what, "training")
        _check_float_dtype(torch.from_numpy(source.x[:1]), floats, what)
        return source
    rows = sample_rows(len(source), seed=seed)
    said = f"{len(rows)} of its {len(source)} samples (the first two and a seeded sample)"
    try:
        x, y = source.batch(rows)
    except ValueError as err:
        raise ValueError(f"{what}: reading {said}: {err}") from err
    _check_float_dtype(x, floats, what)
    for name, t in (("inputs", x), ("labels", y)):
        if len(bad := nonfinite_rows(t)):
            raise ValueError(
                f"{what} has non-finite {name} (NaN or inf) in {len(bad)} of {said}; training "
                "on them makes every stage's output non-finite: clean or impute them in "
                "the data set's transform"
            )
    return Split(x.numpy(), y.numpy())


def check_labels(
    probe: Split,
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    what: str,
    reduction: Any = None,  # noqa: ANN401 - a LossReduction
) -> None:
    """Refuse labels the loss cannot take, on the data owner before any step: ``loss_fn``
    on ``model``'s output (eval mode, no gradient) for the samples
    :func:`sky_flower.pipeline.inputs.probe_rows` picks from ``probe`` (what
    :func:`check_source` read: the first two and those holding the smallest and the
    largest label and token id), so a label outside the model's outputs fails here,
    naming the labels and the width, instead of on the last stage's helper mid-round.

    A loss that fails for another reason is left to fail where it runs in training (the
    last stage, which names itself).

    Given the run's ``reduction`` (:class:`sky_flower.pipeline.objective.LossReduction`,
    run config ``loss-reduction`` and ``loss-weight``), the loss of these samples must
    also equal its two halves' combined as declared: a mean over the tokens not ``-100``
    declared ``mean`` would scale every micro-batch by ``1 / M`` instead of by its
    tokens, and split training would silently differ from unsplit.

    Raises
    ------
    ValueError
        When the model cannot run on the samples (naming ``what``, their shape and
        dtype, and for integer inputs to a float model the conversion to write); when
        the loss fails and integer labels lie outside the model's output width (naming
        ``what``, the labels' range, the width and the loss's error); or when the loss
        does not reduce as ``reduction`` declares (naming ``loss-reduction`` and what to
        set).
    """
    from sky_flower.pipeline.inputs import label_range_error, probe_rows

    x, y = probe.batch(np.asarray(probe_rows(probe)))
    with torch.no_grad():
        try:
            out = model.eval()(x)
        except (IndexError, RuntimeError, TypeError, ValueError) as err:
            raise ValueError(_input_error(x, model, what, err)) from err
        try:
            loss = loss_fn(out, y)
        except (IndexError, RuntimeError, ValueError) as err:
            words = label_range_error(probe.y, int(out.shape[-1]), what, type(model).__name__)
            if words:  # another failure of the loss is the last stage's to report
                raise ValueError(f"{words} ({err})") from err
            return
    if reduction is not None and torch.is_tensor(loss) and loss.numel() == 1:
        from sky_flower.pipeline.objective import check_reduction

        try:
            check_reduction(out, y, loss_fn, reduction, float(loss), "loss", "loss-reduction")
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from err


def _input_error(x: torch.Tensor, model: torch.nn.Module, what: str, err: Exception) -> str:
    """Why ``model`` failed on ``what``'s inputs ``x``, and what to change."""
    dtype = str(x.dtype).removeprefix("torch.")
    text = (
        f"{what}'s samples (each {list(x.shape[1:])}, {dtype}) do not run through the "
        f"model {type(model).__name__} ({err})"
    )
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if floats and not x.dtype.is_floating_point:
        text += (
            f": its parameters are {str(floats[0]).removeprefix('torch.')} and the inputs "
            f"{dtype} (pixels as integers?): convert them in the data set's transform or "
            "load_data (x.float() / 255, torchvision's ToTensor)"
        )
    else:
        text += ": check the model's input shape against the data's"
    return text


def nonfinite_rows(t: torch.Tensor) -> torch.Tensor:
    """Indices of the rows (first dimension) of ``t`` that hold ``NaN`` or ``inf``
    (none for an integer tensor)."""
    if not t.dtype.is_floating_point or t.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    return (~torch.isfinite(t.reshape(len(t), -1))).any(dim=1).nonzero().flatten()


def _check_float_dtype(x: torch.Tensor, floats: list[torch.dtype], what: str) -> None:
    """Float inputs of another float dtype than the model's parameters are refused."""
    if floats and x.dtype.is_floating_point and x.dtype != floats[0]:
        raise ValueError(
            f"{what} has {str(x.dtype).removeprefix('torch.')} inputs but the model's "
            f"parameters are {str(floats[0]).removeprefix('torch.')}: convert them in "
            "load_data (numpy: x.astype(np.float32)) or in the data set's transform"
        )


def probe_split(source: Any, seed: int = 0) -> Any:  # noqa: ANN401 - a source in, a Split out
    """What the up-front checks read of ``source``: a
    :class:`Split` as it is, any other source as the Split of
    its :func:`sample_rows` (read as the data owner reads a batch)."""
    if isinstance(source, Split):
        return source
    x, y = source.batch(sample_rows(len(source), seed=seed))
    return Split(x.numpy(), y.numpy())


def batches(source: Any, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN401
    """``source`` in order, ``size`` samples at a time (the last batch smaller): what a
    server-side evaluation reads."""
    for start in range(0, len(source), size):
        yield source.batch(np.arange(start, min(start + size, len(source))))
