"""The one training loop, and how a run is prepared for it (notebook 02).

``prepare`` builds the course model, the run's device mesh and the optimizer, and applies the run's
strategy: the row of the record (``course_utils.strategies``) holds the apply function
(``apply(model, mesh, options) -> model``) and, for a strategy that shards the optimizer state itself,
a wrapper around the loop's optimizer factory. ``run_steps`` is the loop itself: step, and tell the
observers. Everything that trains in the course steps through ``run_steps``: ``train.train_worker``
(runs launched by ``train``), each notebook's experiments (``course_utils.labs``), the dress rehearsal
and the TorchFT replica. The run types (``TrainConfig``, ``Prepared``) are ``course_utils.runtypes``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .apply import options_for
from .data import batch_for_rank
from .instrument import CountCollectives, optimizer_tensors
from .models import build_meta_model, build_model, get_config, init_weights
from .runtypes import Prepared, TrainConfig
from .strategies import STRATEGIES, Strategy, runnable


def optimizer_factory(cfg: TrainConfig) -> Callable:
    """The course optimizer as a factory of parameters: Adam with the run's learning rate (notebook 02).

    The same for every strategy; a strategy that shards the optimizer wraps this factory
    (``Strategy.optimizer``). ``foreach=False`` keeps the per-tensor arithmetic identical however
    parameters are grouped.
    """
    return functools.partial(torch.optim.Adam, lr=cfg.lr, foreach=False)


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``optimizer_factory(cfg)(params)``: the course optimizer over ``params`` (notebook 02)."""
    return optimizer_factory(cfg)(params)


def module_held(model, optimizer) -> tuple:
    """``(params, grads, optimizer state)`` of a plain module and torch optimizer (notebook 02)."""
    params = list(model.parameters())
    return params, [p.grad for p in params], optimizer_tensors(optimizer)


def full_state_dict(model) -> dict:
    """Every rank gets the full, unsharded weights keyed like ``build_model().state_dict()`` (notebook 04).

    ``get_model_state_dict(full_state_dict=True)``: a plain module's own tensors, the module inside a
    DDP wrapper, each DTensor all-gathered (FSDP2) or each flat parameter unsharded (FSDP1); the tied
    ``head.weight`` appears under its own key as in an unsharded model, so ``weights_sha256`` compares
    across strategies. A collective for sharded models.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def one_process(device="cpu"):
    """This process alone, with no process group: the ``DistInfo`` of a run of the loop in the calling
    process (notebook 01's measurement, the dress rehearsal's fake ranks) (notebook 01)."""
    from .dist import DistInfo

    return DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, backend="none", device=torch.device(device))


#: Meshes already built in this process, keyed by (device type, shape, names); each entry keeps
#: the default process group it was built under, so a new session never reuses a stale one.
_MESHES: dict = {}


def device_mesh(strategy: Strategy, info, node_size: int = 2):
    """The ``DeviceMesh`` a strategy runs on, on this run's device type (notebook 04).

    The device type comes from ``info.device``: on a host with CUDA, FSDP2's default mesh would
    be a CUDA mesh even for gloo/CPU workers, so it is always passed explicitly. A mesh is built
    once per process and shape (building one creates process groups; DTensor also caches its
    sharding decisions per mesh, so many runs in one launch share the work).
    """
    import torch.distributed as dist

    from . import dist as cdist

    shape, names = strategy.mesh_shape(info.world_size, node_size)
    key = (info.device.type, shape, names)
    world, mesh = _MESHES.get(key, (None, None))
    if world is not dist.group.WORLD:
        mesh = cdist.init_mesh(info, shape, names)
        _MESHES[key] = (dist.group.WORLD, mesh)
    return mesh


def prepare(cfg: TrainConfig, info, strategy: Strategy | None = None) -> Prepared:
    """Build the course model and the optimizer, and apply the run's strategy (notebook 02).

    ``strategy``: the row to apply (default: ``cfg.strategy``'s, looked up in the record). A row that
    may (``builds_on_meta``) gets the model built on the meta device and initialised after sharding
    (``models.build_meta_model`` + ``models.init_weights``), as FSDP2 users do for models that do not
    fit on one device: no rank ever holds the whole model. The weights are
    ``build_model(cfg.model, cfg.seed)``'s, bit for bit. The other strategies build it whole.
    """
    strategy = runnable(strategy or cfg.strategy)
    options = options_for(strategy, cfg, info.device, with_knobs=[s for s in STRATEGIES.values() if s.knobs])
    mesh = None if strategy.single_process else device_mesh(strategy, info, cfg.node_size)
    meta = strategy.builds_on_meta and options.meta
    model = (
        build_meta_model(cfg.model) if meta else build_model(get_config(cfg.model), seed=cfg.seed, device=info.device)
    )
    model = strategy.apply(model, mesh, options)
    if meta:  # each rank materialises only its shards
        init_weights(model, cfg.seed, "cpu" if dict(options.knobs).get("offload") else info.device)
    factory = optimizer_factory(cfg)
    optimizer = strategy.optimizer(model, factory, mesh, options) if strategy.optimizer else factory(model.parameters())
    return prepared_from(strategy, model, optimizer, mesh, options)


def prepared_from(strategy: Strategy, model, optimizer, mesh=None, options=None) -> Prepared:
    """What the loop, the checkpointer and the report need, read from what a strategy built (notebook 02).

    Each piece comes from the objects when they offer it (``course_utils.apply``'s docstring: a
    model's ``finish_gradient_synchronization``, ``full_state_dict``, ``describe``, ``observers``; an
    optimizer's ``held``, ``full_state_dict(model)``, ``describe``), from the row's ``describe`` and
    ``observe`` for models torch's own API built, and from torch's generic state-dict API otherwise.
    The report a model describes itself in is kept, not copied: it may go on counting during the run.
    """
    full = getattr(model, "full_state_dict", None)  # a module that knows its full weights (ZeRO-3, BucketedDDP)
    if not callable(full):
        opt_full = getattr(optimizer, "full_state_dict", None)  # the flat fp32 masters of stages 1 and 2
        full = functools.partial(opt_full, model) if callable(opt_full) else functools.partial(full_state_dict, model)
    held = getattr(optimizer, "held", None) or functools.partial(module_held, model, optimizer)
    reports = [d() for d in (getattr(model, "describe", None), getattr(optimizer, "describe", None)) if callable(d)]
    if strategy.describe is not None:
        reports.append(strategy.describe(model, mesh, options))
    info = reports[0] if reports else {}
    for report in reports[1:]:
        info.update(report)
    observers = getattr(model, "observers", None)
    observers = list(observers()) if callable(observers) else []
    if strategy.observe is not None:
        observers += strategy.observe(model, info)
    return Prepared(
        model=model,
        optimizer=optimizer,
        full_state_dict=full,
        held=held,
        before_step=getattr(model, "finish_gradient_synchronization", None) or (lambda: None),
        info=info,
        observers=observers,
    )


def run_steps(
    prepared: Prepared,
    cfg: TrainConfig,
    info,
    steps,
    observers=(),
    *,
    rank: int | None = None,
    world: int | None = None,
    data: Callable | None = None,
) -> list[torch.Tensor]:
    """The training loop: every run of the course steps through here (notebook 02).

    Args:
        prepared: what ``prepare`` built (model, optimizer, ``before_step``).
        cfg: the run's ``TrainConfig`` (model, global batch, seed pick the data).
        info: this rank's ``DistInfo`` (device, rank, world size).
        steps: the step numbers to run, e.g. ``range(start, cfg.steps)``; step k always sees
            the same global batch (``data.batch_for_rank``).
        observers: ``instrument.Observer`` objects that watch the loop (bytes held, bytes sent,
            timelines, socket bytes, per-step hooks); none in a timing run.
        rank, world: the share of the batch to train on, if not this rank's (the one-process
            reference on rank 0 uses ``rank=0, world=1``: the whole global batch).
        data: ``data(step, rank, world) -> (inputs, targets)`` where the batch does not come from
            ``data.batch_for_rank`` (the dress rehearsal's fake tokens).

    Returns this rank's loss of each step, detached and still on the device: the loop never
    waits for the device (``global_mean_losses`` fetches them once, at the end).
    """
    mcfg = get_config(cfg.model)
    rank = info.rank if rank is None else rank
    world = info.world_size if world is None else world
    if data is None:
        data = functools.partial(
            _course_batch, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab, seed=cfg.seed, device=info.device
        )
    losses: list[torch.Tensor] = []
    counters = [o.comm for o in observers if isinstance(o, CountCollectives)]

    def tell(hook: str, *args) -> None:
        for comm in counters:  # watching is not training: its collectives are not counted
            comm.paused = True
        for observer in observers:
            getattr(observer, hook)(*args)
        for comm in counters:
            comm.paused = False

    for observer in observers:
        observer.start()
    try:
        for step in steps:
            x, y = data(step, rank, world)
            tell("before_forward", step)
            loss = prepared.model(x, y)
            tell("after_forward", step, loss)
            loss.backward()
            tell("after_backward", step)
            prepared.before_step()
            tell("before_update", step)
            prepared.optimizer.step()
            tell("after_update", step)
            prepared.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            tell("after_step", step, losses)
    finally:
        for observer in reversed(observers):
            observer.stop()
    return losses


def _course_batch(step, rank, world, **kwargs):
    return batch_for_rank(step, rank, world, **kwargs)


__all__ = [
    "TrainConfig",
    "Prepared",
    "optimizer_factory",
    "make_optimizer",
    "module_held",
    "full_state_dict",
    "device_mesh",
    "one_process",
    "prepare",
    "prepared_from",
    "run_steps",
]
