"""What the launcher's agent changes in torch elastic for a run on one machine (private; used by ``_agent``).

Each function patches one thing, in the agent's own process only (called by ``_agent.run_agent`` after
the fork): its stores listen on loopback, its rendezvous skips two costs that buy nothing on one node, its
log tails poll faster, and with the file timer on, the timer's own record of each worker it reaps
reaches the run's agent log.
"""

from __future__ import annotations

import logging
import os
import sys


def stores_listen_on_loopback() -> None:
    """Make the agent's TCPStore servers listen on 127.0.0.1 only (single-machine runs).

    torch's TCPStore server binds every interface whatever host it is given; a run of this
    course on one machine needs nothing beyond loopback. TCPStore takes an already-bound
    listening socket (``master_listen_fd``), so the two stores an agent creates (the c10d
    rendezvous store, and the store it shares with the workers) get a socket bound to
    127.0.0.1 instead. The workers reach it because the node's address is 127.0.0.1 too
    (``LaunchConfig(local_addr=...)``).
    """
    import socket

    import torch.distributed as tdist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    def loopback_store(host_name, port, world_size=None, is_master=False, **kwargs):
        if not is_master:
            return tdist.TCPStore(host_name, port, world_size, is_master, **kwargs)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        return tdist.TCPStore(
            "127.0.0.1", sock.getsockname()[1], world_size, True, master_listen_fd=sock.detach(), **kwargs
        )

    c10d_rendezvous_backend.TCPStore = loopback_store
    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = lambda self, addr, port: loopback_store(
        addr, port, is_master=True, multi_tenant=True
    )


def rendezvous_without_stack_walks() -> None:
    """Keep what torch's rendezvous does for one machine, minus two costs that buy nothing there.

    Measured with py-spy on a launch of a function that returns at once (2 ranks, this machine): the
    launch took 1.03 s, and the agent spent 39% of it in ``dynamic_rendezvous.get_method_name``, which
    names each rendezvous event by calling ``inspect.stack()`` twice: that reads the source lines of every
    frame and searches ``sys.modules`` for each (python/cpython#92041), about 20 times per rendezvous. And 15%
    in a random pause of 0 to 0.3 s before the first round, which spreads the first attempts of *several
    nodes* apart; this agent is the only node (``max_nodes=1``). The event names stay the same: the frame
    ``depth`` levels up, read directly. Pauses given as one number (the polls between rounds) stay.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth=2):
        try:
            return sys._getframe(depth).f_code.co_name  # its own frame is depth 0, as in inspect.stack()
        except ValueError:  # a stack shallower than depth
            return "no_method_name"

    original_delay = dynamic_rendezvous._delay

    def delay(seconds):
        if not isinstance(seconds, tuple):  # a (low, high) range is the skew between nodes: one node here
            original_delay(seconds)

    dynamic_rendezvous.get_method_name = get_method_name
    dynamic_rendezvous._delay = delay


def tail_logs_promptly() -> None:
    """Tee the workers' output with 20 ms polls instead of torch's 100 ms.

    Every launch ends by stopping its two ``TailLog`` (stdout, stderr) one after the other, and each stop
    waits for its threads' current sleep: 0.1 s each by default, most of what was left between the
    workers' return and the launch's (py-spy, after ``rendezvous_without_stack_walks``).
    """
    import functools

    from torch.distributed.elastic.multiprocessing import api, tail_log

    api.TailLog = functools.partial(tail_log.TailLog, interval_sec=0.02)


def log_file_timer_reaping() -> None:
    """With ``TORCHELASTIC_ENABLE_FILE_TIMER=1``: the file timer's own INFO lines in the agent log, timed.

    torch's ``FileTimerServer`` logs ``Reaping worker_pid=[PID]`` just before it SIGKILLs a worker past
    its deadline, and ``Terminating the server process`` before it kills the agent (INFO, which
    ``run_agent`` otherwise silences). Each line starts with its ``time.time()``: when the timer acted,
    by the timer's own record (``hangs.file_timer_hang`` reads them), not when the launcher saw the run end.
    """
    if os.environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") != "1":
        return
    from torch.distributed.elastic.timer import file_based_local_timer

    handler = logging.StreamHandler()  # the agent's stderr: the run's agent.log
    handler.setFormatter(logging.Formatter("file timer %(created).3f: %(message)s"))
    file_based_local_timer.logger.setLevel(logging.INFO)
    file_based_local_timer.logger.addHandler(handler)
