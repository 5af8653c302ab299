"""Run any course worker function under plain torchrun (introduced in notebook 00).

One machine, four processes::

    torchrun --standalone --nproc-per-node 4 -m course_utils.worker course_utils.examples:all_reduce_demo

Two machines of 8 GPUs (run the same line on both; HOST is the first machine)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m course_utils.worker course_utils.examples:all_reduce_demo

Positional and keyword arguments travel as JSON: ``--args '[1, 2]' --kwargs '{"n": 4}'``.
Each rank prints its return value as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ._agent import call
from .dist import print_line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.worker", description=__doc__.split("\n")[0])
    parser.add_argument("target", help="module:function, e.g. course_utils.examples:all_reduce_demo")
    parser.add_argument("--args", default="[]", help="JSON list of positional arguments")
    parser.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments")
    ns = parser.parse_args(argv)
    try:
        args, kwargs = json.loads(ns.args), json.loads(ns.kwargs)
    except json.JSONDecodeError as exc:
        print(f"python -m course_utils.worker: error: --args/--kwargs must be JSON ({exc})", file=sys.stderr)
        return 2
    value = call(ns.target, tuple(args), kwargs)
    print_line(json.dumps({"rank": int(os.environ.get("RANK", 0)), "result": value}, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
