"""The shared finite check: every non-finite entry is named, integers never are."""

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord

from sky_flower.flower.finite import NonFiniteError, check_finite, json_safe, nonfinite_names


def test_names_every_nonfinite_entry_of_each_container() -> None:
    sd = {"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")]), "c": torch.tensor([1, 2])}
    assert nonfinite_names(sd) == ["b"]
    assert nonfinite_names(ArrayRecord(sd)) == ["b"]
    assert nonfinite_names(MetricRecord({"loss": float("inf"), "acc": 0.5})) == ["loss"]
    assert nonfinite_names(np.array([1.0, -np.inf])) == [""]
    assert nonfinite_names(np.arange(3)) == []


def test_check_finite_raises_with_what_and_names() -> None:
    with pytest.raises(NonFiniteError, match=r"stage 1's activations .* in w"):
        check_finite({"w": torch.tensor([float("inf")])}, "stage 1's activations")
    check_finite({"w": torch.zeros(3)}, "fine")


def test_json_safe_replaces_and_locates_nonfinite_floats() -> None:
    payload = {"rows": [{"loss": float("nan"), "x": np.float32(1.5)}], "t": (1.0, float("inf"))}
    clean, where = json_safe(payload)
    assert json.loads(json.dumps(clean, allow_nan=False)) == {
        "rows": [{"loss": None, "x": 1.5}],
        "t": [1.0, None],
    }
    assert where == ["rows[0].loss", "t[1]"]
