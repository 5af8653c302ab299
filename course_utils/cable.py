"""What a node's network card really sent: the cable's own counter, read where the rank runs (notebook 05).

On the course's cluster (``course_utils.namespaces``) each node is a network namespace whose one card, ``eth0``,
is one end of a veth cable. Linux counts every byte a card transmits, headers and acknowledgements included,
and ``/proc/net/dev`` shows the counters of the reading process's own namespace: a rank reads its node's cable
with no help from outside. ``CableBytes`` reads it around the steps of a run, so the bytes that crossed can be
held against the collectives the course counts (``instrument.CountCollectives``, the ring model) and against
the planner's formula. On one host (no namespace of its own) there is no ``eth0``, and it reports None.
"""

from __future__ import annotations

import torch.distributed as dist

from .instrument import Observer
from .namespaces import IFACE


def transmitted(iface: str = IFACE) -> int | None:
    """Bytes ``iface`` of this process's network namespace has sent so far (``/proc/net/dev``), or None."""
    try:
        with open("/proc/net/dev") as fh:
            for line in fh:
                name, sep, fields = line.partition(":")
                if sep and name.strip() == iface:
                    return int(fields.split()[8])  # receive: 8 fields, then transmit: bytes first
    except (OSError, ValueError, IndexError):
        return None
    return None


class CableBytes(Observer):
    """Bytes this node's card sent from the first step's start to the last step's end (notebook 05).

    The ranks meet at a barrier on each side of the first reading (so no rank's first collective starts before
    its node's card was read) and after the last step; the barriers' few hundred bytes are in the count. Every
    rank of a node reads the same card: ``result()`` is the node's count on its first local rank and None on the
    others (and None where there is no card)."""

    def __init__(self, first_step: int, last_step: int, local_rank: int, iface: str = IFACE):
        self.first, self.last, self.local_rank, self.iface = first_step, last_step, local_rank, iface
        self.before = self.after = None

    def before_forward(self, step: int) -> None:
        if step == self.first:
            dist.barrier()  # every rank's setup traffic is over...
            self.before = transmitted(self.iface)
            dist.barrier()  # ...and no rank sends a byte of the steps before its node's card was read

    def after_step(self, step: int, losses: list) -> None:
        if step == self.last:
            dist.barrier()
            self.after = transmitted(self.iface)

    def result(self) -> int | None:
        if self.local_rank != 0 or self.before is None or self.after is None:
            return None
        return self.after - self.before
