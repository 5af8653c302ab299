"""The launcher's agent process (private; started by course_utils.launch).

``launch`` runs torch's elastic agent here, in a child process of the notebook kernel, in a
session of its own. That keeps the agent's signal handlers out of the kernel, and lets the
kernel end the agent and every worker at once (one process group) on a timeout or on the
notebook's stop button. Usage: ``python -m course_utils._agent SPEC.pkl RESULT.pkl``.
"""
from __future__ import annotations

import importlib
import logging
import pickle
import sys
import traceback
import uuid


def call(target: str, args: tuple, kwargs: dict):
    """Worker entry point: import ``module:qualname`` and call it (runs in each worker)."""
    module, _, qualname = target.partition(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn(*args, **kwargs)


def main(spec_path: str, result_path: str) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with open(spec_path, "rb") as fh:
        spec = pickle.load(fh)
    # The agent's own INFO logging is noise in a notebook; warnings and errors still show.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=spec["nproc"],
        run_id=f"course-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",             # LaunchConfig's default is "etcd"; torchrun's is c10d
        rdzv_endpoint="localhost:0",     # port 0: the OS picks a free port every run
        max_restarts=spec["max_restarts"],  # LaunchConfig's default is 3, torchrun's 0: always explicit
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=spec["log_dir"], tee=Std.ALL),
    )
    try:
        values = elastic_launch(config, call)(spec["target"], spec["args"], spec["kwargs"])
        result = {"ok": True, "values": dict(values)}
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        result = {"ok": False, "rank": rank, "message": exc.format_msg(),
                  "exitcode": first.exitcode}
    except Exception:  # the agent itself failed (rendezvous, pickling...)
        result = {"ok": False, "rank": None, "message": traceback.format_exc(), "exitcode": None}
    with open(result_path, "wb") as fh:
        pickle.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
