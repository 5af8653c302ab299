"""Does a restarted torchrun group still need ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``? (notebook 06)

torch 2.13's torchrun hands its rendezvous TCPStore to the workers (``TORCHELASTIC_USE_AGENT_STORE=True``)
and keeps that store across restarts. A worker that joins with plain ``init_process_group`` (env://)
then uses the same keys in every attempt, and a restarted gloo group can read the dead attempt's
addresses. This script runs a two-rank gloo job under ``torchrun --max-restarts 1`` in which rank 1
dies after one all-reduce on the first attempt, ``--tries`` times in each of three set-ups:

- ``plain``: ``init_process_group("gloo")``, the store shared (torch's default);
- ``attempt_store``: the course's ``course_utils.dist.attempt_store`` (a key prefix per attempt), the store shared;
- ``plain, unshared``: ``init_process_group("gloo")`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.

It prints, per set-up, how many tries finished (both ranks of the restarted attempt done) and the
errors seen. Run it on a quiet machine: the failure is a race, so it shows in some tries, not all::

    python tools/torchrun_store_check.py --tries 5
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
timeout = timedelta(seconds=20)
if sys.argv[1] == "attempt_store":
    from course_utils.dist import attempt_store
    dist.init_process_group("gloo", store=attempt_store(timeout), rank=rank, world_size=world, timeout=timeout)
else:
    dist.init_process_group("gloo", timeout=timeout)
t = torch.ones(1)
dist.all_reduce(t)
if attempt == 0 and rank == 1:
    os._exit(1)  # a lost rank: no clean-up
dist.all_reduce(t)
print(f"attempt {attempt} rank {rank} done", flush=True)
dist.destroy_process_group()
"""

SETUPS = {"plain": ("plain", "0"), "attempt_store": ("attempt_store", "0"), "plain, unshared": ("plain", "1")}
ERRORS = re.compile(r"Connection refused|connectFullMesh[^\n]{0,80}|timed out[^\n]{0,60}|Socket Timeout")


def one_try(worker: Path, mode: str, disable_share: str, timeout_s: float) -> tuple[bool, str]:
    env = {
        **os.environ,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": disable_share,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--monitor-interval",
        "0.1",
        str(worker),
        mode,
    ]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and every worker: they share its session
        out, _ = proc.communicate()
        return False, "hung"
    finished = out.count("attempt 1 rank") == 2 and proc.returncode == 0
    seen = sorted(set(m.group() for m in ERRORS.finditer(out)))
    return finished, "; ".join(seen)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=90.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(WORKER)
        for name, (mode, disable_share) in SETUPS.items():
            results = []
            for _ in range(args.tries):
                start = time.monotonic()
                ok, errors = one_try(worker, mode, disable_share, args.timeout_s)
                results.append(ok)
                print(
                    f"  {name}: {'finished' if ok else 'FAILED'} in {time.monotonic() - start:.1f} s"
                    + (f" ({errors})" if errors and not ok else ""),
                    flush=True,
                )
            print(f"{name}: {sum(results)} of {len(results)} tries finished", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
