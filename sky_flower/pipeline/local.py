"""``torch.distributed.pipelining`` alone, without Flower: one local process per stage.

The engine of the transport benchmark's case (b) (:func:`run_local`): the same
:func:`~sky_flower.pipeline.engine.run_stage` as a ``direct`` round over Flower, each
stage in a spawned process, the rendezvous hosted by the parent. Also the shape helper
the server uses to build every stage with static shapes (:func:`stage_input_shapes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from sky_flower.core.example import example_input
from sky_flower.pipeline.emulated import Emulated
from sky_flower.pipeline.engine import MULTI_CHUNK, Chunk, StageResult, run_stage
from sky_flower.pipeline.rendezvous import DirectStageError, Rendezvous, RoundHost
from sky_flower.pipeline.stage import RngKey


def _local_worker(  # noqa: PLR0913
    rdv: Rendezvous,
    model_cfg: dict,
    parts: list[tuple[int, tuple[int, int], tuple]],
    weights: dict,
    optimizer: str,
    lr: float,
    kind: str,
    microbatches: int,
    batches: list | None,
    steps: int,
    batch_size: int,
    slowdown: float,
    queue: object,
    input_dtype: torch.dtype | None = None,
    rng: RngKey | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    metric_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
) -> None:
    """Stage process of :func:`run_local`: its chunks ``(index, (first, last), input
    shape)`` (one for GPipe / 1F1B), one round, its weights and results to ``queue``."""
    from sky_flower.pipeline.models import build_model
    from sky_flower.pipeline.stage import build_stage, slice_state, stage_optimizer

    torch.set_num_threads(1)
    try:
        chunks = [
            Chunk(
                c,
                build_stage(lambda: build_model(model_cfg), a, b, slice_state(weights, a, b)),
                tuple(shape),
                input_dtype if c == 0 else None,
            )
            for c, (a, b), shape in parts
        ]
        module = nn.Sequential(*(ch.module for ch in chunks))  # every chunk's parameters
        res = run_stage(
            rdv,
            chunks if kind in MULTI_CHUNK else chunks[0].module,
            stage_optimizer(module, optimizer, lr),
            kind,
            microbatches,
            steps,
            batch_size,
            chunks[0].input_shape,
            batch_fn=(lambda s: batches[s]) if batches is not None else None,
            emulated=Emulated(slowdown=slowdown),
            input_dtype=chunks[0].input_dtype,
            rng=rng,
            loss_fn=loss_fn,
            metric_fn=metric_fn,
        )
        state = {}
        for ch in chunks:
            state.update({k: v.detach().numpy().copy() for k, v in ch.module.state_dict().items()})
        queue.put((rdv.rank, res, state))  # type: ignore[attr-defined]
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        queue.put((rdv.rank, err, None))  # type: ignore[attr-defined]


def run_local(  # noqa: PLR0913
    model_cfg: dict,
    bounds: Sequence[tuple[int, int]],
    weights: dict,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    kind: str = "gpipe",
    microbatches: int = 1,
    optimizer: str = "adam",
    lr: float = 1e-3,
    slowdowns: Sequence[float] | None = None,
    timeout_s: float = 60.0,
    ranks: int | None = None,
    rng: RngKey | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    metric_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    mp_context: Any = None,  # noqa: ANN401 - a multiprocessing context
) -> tuple[dict, list[StageResult]]:
    """``torch.distributed.pipelining`` alone: one local process per stage, no Flower.

    Parameters
    ----------
    model_cfg : dict
        :func:`sky_flower.pipeline.models.build_model` config.
    bounds : sequence of (first, last)
        Layers of each stage (or chunk), in pipeline order.
    weights : dict
        Full-model state dict to start from.
    batches : list of (x (B, ...), labels (B,))
        One batch per step (given to rank 0 only).
    kind, microbatches, optimizer, lr
        As :func:`run_stage` and :func:`sky_flower.core.profile.default_optimizer_factory`.
    slowdowns : sequence of float, optional
        Emulated slowdown per stage.
    timeout_s : float
        Bound on the round, seconds.
    ranks : int, optional
        Processes ``S`` (default one per entry of ``bounds``); with fewer, entry ``c``
        is chunk ``c`` of rank ``c mod S`` (``len(bounds)`` a multiple of ``S``; the
        ``interleaved`` and ``zero_bubble`` kinds).
    rng : RngKey, optional
        Seed and round of the layers' keyed randomness (default seed 0, round 0;
        ``tests/reference.py``'s rounds count from 1).
    loss_fn : callable, optional
        ``(output, labels) -> scalar`` mean loss of a micro-batch (default
        cross-entropy; :func:`sky_flower.pipeline.lm.lm_cross_entropy` for a language
        model); a module-level function (the stage processes are spawned).
    metric_fn : callable, optional
        ``(output, labels) -> count`` of a step (default correct predictions;
        :func:`sky_flower.pipeline.lm.token_correct` for a language model); module level.
    mp_context : multiprocessing context, optional
        Starts the stage processes (default ``spawn``: each a fresh interpreter). A
        ``forkserver`` context whose server preloaded torch starts them in well under a
        second (the tests' ``reference.forkserver``).

    Returns
    -------
    (dict, list of StageResult)
        The trained full-model state dict and each stage's measurements.

    Raises
    ------
    DirectStageError
        If a stage fails or the round does not finish within ``timeout_s`` (+ 30 s for
        process start-up); every process is ended before it is raised.
    """
    import multiprocessing as mp

    from sky_flower.pipeline.models import build_model

    ctx = mp_context or mp.get_context("spawn")
    S = ranks or len(bounds)
    if len(bounds) % S:
        raise ValueError(f"{len(bounds)} chunks do not divide over {S} ranks")
    slowdowns = list(slowdowns or [0.0] * S)
    dtype = batches[0][0].dtype
    shapes = stage_input_shapes(
        lambda: build_model(model_cfg), tuple(batches[0][0].shape[1:]), bounds, dtype
    )
    queue = ctx.Queue()
    procs = []
    with RoundHost(S, timeout_s) as host:
        for k in range(S):
            p = ctx.Process(
                target=_local_worker,
                args=(
                    host.rendezvous(k),
                    dict(model_cfg),
                    [(c, tuple(bounds[c]), shapes[c]) for c in range(k, len(bounds), S)],
                    weights,
                    optimizer,
                    lr,
                    kind,
                    microbatches,
                    batches if k == 0 else None,
                    len(batches),
                    int(batches[0][1].shape[0]),
                    slowdowns[k],
                    queue,
                    dtype,
                    rng,
                    loss_fn,
                    metric_fn,
                ),
                daemon=True,
            )
            p.start()
            procs.append(p)
        got = _collect(queue, procs, S, timeout_s + 30.0)
    return _merge(got, S)


def _collect(queue: Any, procs: list, S: int, wait_s: float) -> dict[int, tuple]:
    """``rank -> (result or error, state)`` from the stage processes, within ``wait_s``
    seconds; every process is ended before it returns."""
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + wait_s
    try:
        while len(got) < S and time.monotonic() < deadline:
            try:
                rank, res, state = queue.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            got[rank] = (res, state)
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
    return got


def _merge(got: dict[int, tuple], S: int) -> tuple[dict, list[StageResult]]:
    """The full-model state dict and the stages' results, or the stages' errors raised."""
    errors = [f"{r}: {v[0]}" for r, v in sorted(got.items()) if isinstance(v[0], BaseException)]
    missing = [k for k in range(S) if k not in got]
    if errors or missing:
        raise DirectStageError(
            "local pipeline failed: "
            + "; ".join(errors + [f"stage {k} gave no result" for k in missing])
        )
    merged: dict = {}
    for k in range(S):
        merged.update({key: torch.from_numpy(v) for key, v in got[k][1].items()})
    return merged, [got[k][0] for k in range(S)]


def stage_input_shapes(
    model_fn: Callable[[], nn.Module],
    input_shape: Sequence[int],
    bounds: Sequence[tuple[int, int]],
    input_dtype: torch.dtype | str | None = None,
) -> list[tuple[int, ...]]:
    """Per-sample input shape of each stage ``(first, last)`` of a layered model.

    Runs the model's layers on the meta device (no memory, no compute), on an input of
    ``input_dtype`` (default float32; int64 for token ids); a model that cannot run
    there (a traced one: its graph names devices) on two real samples instead.

    Returns
    -------
    list of tuple of int
        ``shapes[k]`` = shape of one sample entering stage ``k`` (no batch dimension).
    """
    from sky_flower.core.profile import as_layers
    from sky_flower.pipeline.stage import probe_forward

    def run(layers: Sequence[nn.Module], h: torch.Tensor, step: Callable) -> list:  # noqa: ANN001
        shapes = []
        for first, last in bounds:
            shapes.append(tuple(int(d) for d in h.shape[1:]))
            for j in range(first, last + 1):
                h = step(layers[j], h)
        return shapes

    try:
        with torch.device("meta"):
            layers = as_layers(model_fn())
            h = example_input(2, input_shape, input_dtype)  # 2: BatchNorm in train mode
            return run(layers, h, lambda layer, x: layer(x))
    except Exception:  # noqa: BLE001 - a real error raises again below, on the CPU
        # a traced model (sky_flower.pipeline.graph.as_sequential) holds its tensors and
        # the devices its graph names (a mask's .to("cpu")) as traced: run it on two real
        # samples instead, without side effects on buffers or the random stream
        layers = as_layers(model_fn())
        h = example_input(2, input_shape, input_dtype)
        return run(layers, h, probe_forward)
