"""Notebook 03's DeepSpeed section: DeepSpeed's ZeRO stages 1-3 beside the hand-built ones, in one launch.

ZeRO comes from DeepSpeed, so the course checks its hand-built stages against the library the paper
describes: ``beside`` launches once (2 CPU ranks, gloo, ``DS_ACCELERATOR=cpu``) and, for each of the
record's ZeRO rows, trains DeepSpeed 0.19.8 and the course's stage from the same seed, data and
optimizer (the course's Adam as DeepSpeed's client optimizer), compares every final weight bit for bit
and every loss, and counts what DeepSpeed holds per rank between steps, named by where DeepSpeed keeps
it (``lab03_ds_census``: where DeepSpeed keeps each part, and ``expected_held``, what that count should be,
in Ψ and N, from DeepSpeed's source).

DeepSpeed is an optional extra (``make setup`` installs it; elsewhere ``pip install deepspeed==0.19.8``):
``available()`` asks without importing it, and nothing here imports it outside the launched ranks.

Five of DeepSpeed's defaults would spoil the comparison on a CPU (each was hit while building this):
  - every ``TorchBackend`` JIT-compiles a shared-memory all-reduce op with g++ (about 50 s per rank;
    ``deepspeed/comm/torch.py:207``), which serves only inference, and a killed build leaves a lock file
    every later build waits on forever: ``_no_shm_build`` skips it, and ``TORCH_EXTENSIONS_DIR`` is a
    private folder removed after the launch, so no lock outlives a run;
  - ``reduce_bucket_size`` and ``allgather_bucket_size`` default to 5e8 elements (2 GB of fp32 per rank,
    ``runtime/zero/config.py:113,132``): ``BUCKET_ELEMENTS`` here;
  - stage 3's ``stage3_param_persistence_threshold`` (1e5, ``config.py:228``) keeps every parameter of a
    model this small whole on every rank: 0 shards them all;
  - ``gradient_clipping`` defaults to 1.0 (``runtime/constants.py:203``) and the course does not clip: 0.0;
  - stage 3's ``memory_efficient_linear`` replaces ``torch.nn.functional.linear`` for the whole process
    (``OWN_LINEAR``): off, except in the run that shows what it does, and undone after each run.

What it costs (CPU seconds per rank, measured on this 2-core machine): ``import deepspeed`` 0.4-0.7 s; the
first ZeRO ``initialize`` about 2 s, most of it DeepSpeed importing its Muon optimizer, whose kernels are
``@torch.compile``-decorated (``runtime/zero/utils.py:72``, and again without a guard in ``stage_1_and_2.py:1592``,
so it cannot be skipped); each later stage 0.1-0.7 s. The whole launch: about 9 s wall at a load of 4.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import shutil
import tempfile
from dataclasses import asdict

import torch
import torch.distributed as dist

from .. import dist as cdist
from ..data import batch_for_rank
from ..instrument import CommCounter, HeldAtRest, weights_sha256
from ..launch import launch
from ..loop import TrainConfig, make_optimizer, prepare, run_steps
from ..models import build_model, get_config
from ..strategies import ZERO1, ZERO2, ZERO3, Strategy
from ..timeline import StepTimeline
from .lab03_ds_census import (  # noqa: F401 (notebook 03 and its tests read them here)
    BUCKET_ELEMENTS,
    PLACES,
    SCALARS,
    category,
    census,
    census_table,
    expected_held,
    expected_rest,
    expected_scalars,
    partition_gradient_bytes,
    scalars,
)

#: The version the section's claims were read in (``pyproject.toml``'s ``deepspeed`` extra pins it).
VERSION = "0.19.8"
INSTALL_LINE = f"pip install deepspeed=={VERSION}   (make setup installs it)"
#: The record's rows DeepSpeed has a stage for, compared in this order.
STAGES = (ZERO1, ZERO2, ZERO3)
#: Stage 3 once more with DeepSpeed's default ``memory_efficient_linear=True`` (``runtime/zero/config.py:346``):
#: ``deepspeed.initialize`` wraps the model in ``zero.Init`` (``runtime/zero/parameter_offload.py:270``), which
#: replaces ``torch.nn.functional.linear`` for the whole process (``partition_parameters.py:1091``, ``:412-419``:
#: "this will persist unless manually reset") by ``LinearFunctionForZeroStage3`` (``runtime/zero/linear.py:80``):
#: its forward adds the bias after the matmul (``linear.py:92-94``) and its backward computes the weight's
#: gradient with its own matmul, so the same products are rounded in another order.
OWN_LINEAR = "zero3, DeepSpeed's linear"
RUNS = tuple((r.name, r, False) for r in STAGES) + ((OWN_LINEAR, ZERO3, True),)


def available() -> bool:
    """Whether DeepSpeed is installed here, without importing it (that costs seconds)."""
    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_stage(row: Strategy) -> int:
    """The ZeRO stage DeepSpeed calls ``row``: read from the record's ``deepspeed`` config fragment."""
    return json.loads("{" + row.deepspeed + "}")["zero_optimization"]["stage"]


def ds_config(row: Strategy, world: int, batch: int, own_linear: bool = False) -> dict:
    """DeepSpeed's config for the course's run of ``row``: fp32, the global batch over the ranks, small
    buckets, no clipping; stage 3 shards every parameter and gathers each module only while it runs,
    as the course's ``Zero3Module`` does (DeepSpeed's defaults keep a model this small gathered), and
    computes with torch's ``linear`` unless ``own_linear`` (DeepSpeed's default, ``OWN_LINEAR``)."""
    zero = {
        "stage": deepspeed_stage(row),
        "reduce_bucket_size": BUCKET_ELEMENTS,
        "allgather_bucket_size": BUCKET_ELEMENTS,
        "overlap_comm": False,
        "contiguous_gradients": True,
    }
    if row.gathers_units:
        zero.update(
            stage3_param_persistence_threshold=0,
            stage3_prefetch_bucket_size=0,
            stage3_max_live_parameters=0,
            stage3_max_reuse_distance=0,
            memory_efficient_linear=own_linear,
        )
    return {
        "train_micro_batch_size_per_gpu": batch // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


# ------------------------------------------------------------------------------------------ in the ranks


_TORCH_LINEAR = torch.nn.functional.linear


def _no_shm_build() -> None:
    """Skip DeepSpeed's JIT build of its shared-memory inference all-reduce (g++, about 50 s per rank)."""
    # ``deepspeed.comm.torch`` as an attribute is the real ``torch`` (deepspeed.comm imports it): patch the module
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def timeline_roles(engine):
    """``roles()`` for ``timeline.StepTimeline``: DeepSpeed's own tensors by the timeline's categories, read from
    the engine's attributes (0.19.8; ``PLACES`` cites the lines) each time: the weights (stages 1-2: the flat 16-bit
    groups the module's parameters view; stage 3: each parameter's ``ds_tensor``) are params, a stage-3 parameter's
    own data while gathered is gathered, the fp32 master partition and the client Adam's state are optim (the
    timeline's "optimizer state and fp32 master copies"), the gradient partition and every ``.grad`` are grads,
    the reduce buckets (``ipg_buckets``) are comm, also where a ``.grad`` is a view into one."""
    from ..timeline import optimizer_state

    opt, params = engine.optimizer, list(engine.module.parameters())

    def roles() -> dict:
        stage3 = [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
        masters = list(getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat)
        buckets = [b.buffer for b in getattr(opt, "ipg_buckets", {}).values()]
        return {  # a storage takes the first role that claims it: a .grad DeepSpeed copied into a bucket is the bucket
            "params": stage3 + (list(getattr(opt, "bit16_groups_flat", [])) if not stage3 else []),
            "gathered": params if stage3 else [],
            "comm": [t for b in buckets for t in (b if isinstance(b, list) else [b])],
            "grads": [getattr(opt, "grad_partitions_flat_buffer", None)]
            + [p.grad for p in params]
            + [m.grad for m in masters],
            "optim": masters + optimizer_state(opt.optimizer),
        }

    return roles


def _train_deepspeed(deepspeed, row: Strategy, cfg: TrainConfig, info, own_linear: bool = False, timeline=None):
    """DeepSpeed's stage of ``row`` on this rank's share of the course's batches: losses, weights, census; with a
    started ``timeline`` (``timeline.StepTimeline``) its watched step is recorded, phase by phase.
    DeepSpeed owns its step (``engine.backward``, ``engine.step``), so this loop is its own, not ``run_steps``."""
    mcfg = get_config(cfg.model)
    model = build_model(mcfg, seed=cfg.seed)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=make_optimizer(model.parameters(), cfg),
        config=ds_config(row, info.world_size, cfg.batch, own_linear),
    )
    phase = timeline.phase if timeline is not None else (lambda *a: None)
    if timeline is not None:
        timeline.roles = timeline_roles(engine)
    losses, comm = [], CommCounter()
    for step in range(cfg.steps):
        x, y = batch_for_rank(
            step, info.rank, info.world_size, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab, seed=cfg.seed
        )
        with comm if step == cfg.steps - 1 else contextlib.nullcontext():  # the last step's collectives
            phase("forward", step)
            loss = engine(x, y)
            phase("backward")
            engine.backward(loss)
            phase("optimizer")  # DeepSpeed's step: the reduce (stage 1), the update, the all-gather, its zero_grad
            engine.step()
        losses.append(float(loss.detach()))
        if timeline is not None:
            timeline.end_step(step)
    if timeline is not None:
        timeline.stop()
    held = census(engine)
    params = list(engine.module.parameters())
    gathered = deepspeed.zero.GatheredParameters(params) if row.gathers_units else contextlib.nullcontext()
    with gathered:  # stage 3: the whole weights for a moment, to compare them
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    replaced = torch.nn.functional.linear is not _TORCH_LINEAR
    torch.nn.functional.linear = _TORCH_LINEAR  # DeepSpeed's replacement outlives its engine otherwise
    return {"losses": losses, "weights": weights, "census": held, "replaced_linear": replaced, "comm": comm.summary(1)}


def _estimators(deepspeed, psi: int, nd: int, largest_layer: int) -> dict:
    """DeepSpeed's own estimates of a GPU's model-state bytes (mixed precision; none for stage 1)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, two = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=nd, cpu_offload=False)
    _, three, _ = estimate_zero3_model_states_mem_needs(
        psi, largest_layer, num_gpus_per_node=nd, cpu_offload=False, cpu_offload_params=False
    )
    return {1: None, 2: two, 3: three}


def _train_course(row: Strategy, cfg: TrainConfig, info) -> dict:
    """The course's stage of ``row`` through the one loop: losses, full weights, bytes held after the last update."""
    prepared = prepare(cfg, info, row)
    held = HeldAtRest(prepared.held, at=cfg.steps - 1)
    losses = [float(x) for x in run_steps(prepared, cfg, info, range(cfg.steps), [held])]
    return {"losses": losses, "weights": prepared.full_state_dict(), "held": held.bytes}


def worker(config: dict) -> dict:
    """In every rank: each of ``RUNS`` by DeepSpeed beside the course's stage, compared (rank 0 returns it)."""
    cfg = TrainConfig(**config).validate()
    with cdist.session("gloo") as info:
        _no_shm_build()
        deepspeed = importlib.import_module("deepspeed")
        deepspeed.utils.logger.setLevel("ERROR")  # its INFO lines go to the ranks' logs otherwise
        out, course = {}, {}
        for name, row, own_linear in RUNS:
            if row.name not in course:  # the course's stage first, before DeepSpeed has touched torch
                course[row.name] = _train_course(row, cfg, info)
            watch = None if own_linear else StepTimeline(watch_step=cfg.steps - 1).start()  # before the model
            ds, ours = _train_deepspeed(deepspeed, row, cfg, info, own_linear, watch), course[row.name]
            full = ours["weights"]
            mine = {
                "census": ds["census"],
                "course_held": ours["held"],
                "losses_equal": ds["losses"] == ours["losses"],
                "same_keys": sorted(ds["weights"]) == sorted(full),
                "max_abs_diff": max(float((ds["weights"][k].float() - full[k].float()).abs().max()) for k in full),
                "sha_deepspeed": weights_sha256(ds["weights"]),
                "sha_course": weights_sha256(full),
                "losses": ds["losses"],
                "replaced_linear": ds["replaced_linear"],
                "comm": ds["comm"],
                "timeline": watch.result() if watch is not None and info.rank == 0 else None,
            }
            every = [None] * info.world_size
            dist.all_gather_object(every, mine)
            out[name] = every
        model = build_model(get_config(cfg.model), seed=cfg.seed)
        psi = sum(p.numel() for p in model.parameters())
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        estimates = _estimators(deepspeed, psi, info.world_size, largest)
        return {"stages": out, "estimates": estimates} if info.rank == 0 else {}


def beside(cfg: TrainConfig | None = None, **overrides) -> dict:
    """Launch ``worker`` once on ``cfg.nproc`` gloo ranks and return, per run of ``RUNS`` (the row names of
    ``STAGES``, then ``OWN_LINEAR``): whether DeepSpeed's weights equal the course's bit for bit
    (``bit_identical``: max |Δw| 0 and the same ``weights_sha256`` on every rank), ``max_abs_diff``,
    ``losses_equal`` (every rank, every step), ``sha256`` and ``sha256_course`` (rank 0's),
    ``replaced_linear`` (DeepSpeed left ``torch.nn.functional.linear`` replaced: the worker restores it),
    ``per_rank`` (DeepSpeed's census ``by_category`` and the course's bytes held, ``HeldAtRest`` after the
    last update), rank 0's ``storages`` (path, bytes, category), the losses, and ``deepspeed_estimate``
    (DeepSpeed's own estimator for a GPU, mixed precision; None for stage 1), ``comm_per_step`` (rank 0's
    collectives in the last step, ``CommCounter.summary``).
    Defaults: the course model, 2 ranks, 3 steps (notebook 03)."""
    base = asdict(cfg or TrainConfig(strategy=ZERO1.name, nproc=2, steps=3))
    cfg = TrainConfig(**{**base, **overrides}).validate()
    extensions = tempfile.mkdtemp(prefix="course-ds-ext-")  # any JIT build and its lock live and die here
    try:
        result = launch(
            worker,
            nproc=cfg.nproc,
            args=(asdict(cfg),),
            backend="gloo",
            timeout_s=cfg.timeout_s,
            env={"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": extensions},
            echo=False,
        )[0]
    finally:
        shutil.rmtree(extensions, ignore_errors=True)
    out = {}
    for name, row, _ in RUNS:
        ranks = result["stages"][name]
        first = ranks[0]
        equal = all(
            r["max_abs_diff"] == 0.0 and r["sha_deepspeed"] == r["sha_course"] and r["same_keys"] for r in ranks
        )
        out[name] = {
            "stage": deepspeed_stage(row),
            "row": row.name,
            "bit_identical": equal,
            "max_abs_diff": max(r["max_abs_diff"] for r in ranks),
            "sha256": first["sha_deepspeed"],
            "sha256_course": first["sha_course"],
            "losses_equal": all(r["losses_equal"] for r in ranks),
            "losses": first["losses"],
            "replaced_linear": all(r["replaced_linear"] for r in ranks),
            "comm_per_step": first["comm"],
            "per_rank": [{"deepspeed": r["census"]["by_category"], "course": r["course_held"]} for r in ranks],
            "storages": first["census"]["storages"],
            "deepspeed_estimate": result["estimates"][deepspeed_stage(row)],
            "timeline": first["timeline"],
        }
    return out
