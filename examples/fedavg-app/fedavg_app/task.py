"""The model, the data and the training / test loops."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Split:
    """Features ``x`` (float32, ``(n, 64)``, in [0, 1]) and labels ``y`` (int64, ``(n,)``)."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


def _digits() -> tuple[Split, Split]:
    """scikit-learn's digits (shipped with the package: nothing is downloaded), split
    80/20 into train / test, stratified and seeded so every node agrees."""
    from sklearn.datasets import load_digits  # imported here: a ClientApp starts faster
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x, y = (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return Split(xtr, ytr), Split(xte, yte)


def Net() -> nn.Sequential:  # noqa: N802 - a model class in Flower's templates
    """An MLP for 8x8 digits, as an ordered list of layers (input ``(n, 64)``)."""
    return nn.Sequential(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU()),
        nn.Sequential(nn.Linear(256, 256), nn.ReLU()),
        nn.Sequential(nn.Linear(256, 256), nn.ReLU()),
        nn.Linear(256, 10),
    )


def initial_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The global model's initial weights, the same in every process (seeded here, not
    in ``Net``: the global random generator is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net().state_dict()


def load_data(partition_id: int, num_partitions: int) -> Split:
    """IID partition ``partition_id`` of ``num_partitions`` of the digits train split."""
    train, _ = _digits()
    part = np.array_split(np.random.default_rng(0).permutation(len(train)), num_partitions)
    idx = part[partition_id]
    return Split(train.x[idx], train.y[idx])


def load_test() -> Split:
    """The held-out digits test split (20 %, seeded), kept by the server."""
    return _digits()[1]


def train(net: nn.Module, data: Split, epochs: float, lr: float) -> float:
    """Adam on ``data`` in batches of 32 for ``epochs`` passes; returns the mean loss."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    losses = []
    for _ in range(max(1, round(epochs))):
        for idx in torch.randperm(len(y)).split(32):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return sum(losses) / len(losses)


def test(net: nn.Module, data: Split) -> tuple[float, float]:
    """``(loss, accuracy)`` of ``net`` on ``data``."""
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    net.eval()  # dropout off, BatchNorm on its running statistics
    with torch.no_grad():
        out = net(x)
    return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def save_results(run_config: dict, result: object) -> None:
    """Write the run's per-round server-side metrics (a Flower ``Result``) as JSON to the
    run config's ``results-path`` (nothing when it is ``""``). What a strategy recorded
    there itself (Sky: every round's measurements) is kept. The file is strictly valid
    JSON: a NaN or infinite metric is written as ``null``."""
    import json
    import math
    from pathlib import Path

    def finite(v: object) -> object:  # NaN / inf are not JSON: null instead
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        return [finite(x) for x in v] if isinstance(v, list | tuple) else v

    path = str(run_config.get("results-path", ""))
    if not path:
        return
    evaluated = {r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()}  # type: ignore[attr-defined]
    rounds = [{"round": r, **{f"test_{k}": v for k, v in m.items()}} for r, m in evaluated.items()]
    results = {
        "initial_test_accuracy": evaluated.get(0, {}).get("accuracy"),
        "final_test_accuracy": rounds[-1].get("test_accuracy") if rounds else None,
        "rounds": [row for row in rounds if row["round"] > 0],
        "error": None,
        "completed": True,
    }
    own = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    Path(path).write_text(json.dumps(finite({**results, **own}), indent=2, allow_nan=False))
