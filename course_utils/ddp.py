"""Data parallelism: torch's DistributedDataParallel, and a bucketed DDP built by hand (notebook 02).

``apply_ddp`` is the library version every later notebook compares against.
"""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from .train import Prepared, TrainConfig, make_optimizer, module_held


def apply_ddp(model, cfg: TrainConfig, info) -> Prepared:
    """Wrap ``model`` in torch DDP (notebook 02).

    Args:
        model: the course model, built from the same seed on every rank.
        cfg: the run's config; ``cfg.bucket_cap_mb`` caps DDP's gradient buckets.
        info: this rank's ``DistInfo`` (device, rank).

    Every rank keeps the full model, gradients and Adam state: 16Ψ bytes in mixed precision.
    """
    ddp = DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                                  bucket_cap_mb=cfg.bucket_cap_mb)
    optimizer = make_optimizer(ddp.parameters(), cfg)
    return Prepared(model=ddp, optimizer=optimizer,
                    full_state_dict=lambda: {k: v.detach().clone() for k, v in model.state_dict().items()},
                    held=lambda: module_held(model, optimizer),
                    info={"bucket_cap_mb": cfg.bucket_cap_mb})
