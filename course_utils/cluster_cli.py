"""``python -m course_utils cluster ...``: one training run across the namespace nodes, from a shell (notebook 05).

``cluster_arguments`` (``train``'s flags, the cluster's shape and link) and ``cluster_command`` (the run, or
``--clean``); the run itself is ``cluster.train_on_cluster``.
"""

from __future__ import annotations

import signal
import sys

from .cluster import train_on_cluster
from .namespaces import clean_command, parse_link, require


def cluster_arguments(parser) -> None:
    """``train``'s flags, less ``--nproc`` and ``--node-size`` (the cluster's shape sets them), plus its own (notebook 05)."""
    from .train import train_arguments

    train_arguments(parser, one_machine=False)
    parser.set_defaults(strategy="hybrid_shard")  # the strategy a slow link between nodes is for
    parser.add_argument("--nodes", type=int, default=2, help='namespaces ("machines") on the switch')
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node")
    parser.add_argument(
        "--link",
        default="unlimited",
        help="each node's link: unlimited, 100mbit, 1gbit, or RATE,DELAY (delay needs netem)",
    )
    parser.add_argument("--wall-timeout-s", type=float, default=300.0, help="the whole run, then everything is stopped")
    parser.add_argument(
        "--clean",
        action="store_true",
        help="run nothing: remove the namespaces, processes and folders that killed cluster runs left",
    )


class Terminated(Exception):
    """The command was sent SIGTERM: handled as an interrupt, everything of the run removed first."""


def _terminated(signum, frame):
    raise Terminated()


def cluster_command(args) -> int:
    """``python -m course_utils cluster ...`` (notebook 05). SIGTERM ends it as Ctrl-C does: cleanly."""
    from .train import _config_from_args, print_report

    if args.clean:
        return clean_command()
    parse_link(args.link)  # the input first: refusing it needs nothing from this machine
    args.nproc, args.node_size = args.nodes * args.nproc_per_node, args.nproc_per_node
    cfg = _config_from_args(args)
    require()  # then what the machine lacks, before anything is built
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        report = train_on_cluster(
            cfg, nodes=args.nodes, nproc_per_node=args.nproc_per_node, link=args.link, timeout_s=args.wall_timeout_s
        )
    except (RuntimeError, TimeoutError) as exc:  # a failed run, already torn down: say why, no traceback
        print(f"python -m course_utils cluster: {exc}", file=sys.stderr)
        return 1
    except Terminated:
        print(
            "python -m course_utils cluster: stopped by SIGTERM; every process, namespace and folder of the "
            "run was removed",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_report(report, args.json)
    if not args.json:
        print(
            f"link {report['link']['rate'] or 'unlimited'}, delay {report['link']['delay'] or 'none'}; "
            f"{report['cross_node_bytes_per_step']:.0f} B per step from one rank to other nodes"
        )
    return 0
