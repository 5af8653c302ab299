"""What a collective sends: the ring all-reduce simulated step by step, and the volume formulas (notebook 02).

Pure arithmetic: no processes, no ``torch.distributed``. ``ring_all_reduce`` plays N ranks
on numpy arrays, so the result and every message can be checked by hand; the formulas give
elements sent per rank, in the ZeRO paper's accounting (§7):

    all-reduce      2(N−1)/N · Ψ   (reduce-scatter, then all-gather)   the paper rounds it to 2Ψ
    reduce-scatter   (N−1)/N · Ψ
    all-gather       (N−1)/N · Ψ

and per training step, for Ψ parameters over Nd data-parallel ranks: DDP and ZeRO stages 1 and
2 send 2(Nd−1)/Nd · Ψ, stage 3 sends 3(Nd−1)/Nd · Ψ (one more all-gather of the weights): the sum,
over a strategy's collectives (its row of the record, ``course_utils.strategies``), of these factors.
``RING_FACTOR`` is the one copy of them: ``course_utils.instrument`` counts real runs with it, the
predictions and the planner price strategies with it. Nothing here imports torch or the record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import CourseInputError

#: Bytes one rank sends in a ring collective over N ranks, per byte of payload (the tensor the
#: collective is about: the gradient all-reduced, the full parameter gathered, the full gradient
#: scattered). Broadcast and reduce: N−1 ranks must each receive (broadcast) or contribute (reduce) the
#: payload once, so the group sends (N−1)·payload in all under any algorithm that moves each byte once
#: per receiver (a chain, a ring, gloo's binomial tree): (N−1)/N per rank on average. Which ranks send
#: depends on the algorithm (gloo's broadcast from rank 0 on 4 ranks: rank 0 sends 2, rank 1 sends 1,
#: ranks 2 and 3 nothing; measured on the wire, issue 30), so it is the average, as the other rows are.
RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "barrier": lambda n: 0.0,
}


def ring_bytes_sent(kind: str, payload_bytes: float, group_size: int) -> float:
    """Bytes one rank sends for one collective in the ring model (``RING_FACTOR``) (notebook 02)."""
    return RING_FACTOR[kind](group_size) * payload_bytes


#: What torch's gloo backend really sends, per payload byte and rank, where it is not the ring model: it runs a
#: reduce-scatter as an all-reduce of the whole input and keeps this rank's chunk (notebook 04 reads the summation
#: order that follows; notebook 05 measures the bytes on a node's cable). NCCL's reduce-scatter is the ring's.
GLOO_FACTOR = {**RING_FACTOR, "reduce_scatter": RING_FACTOR["all_reduce"]}


def node_card_bytes(kind: str, payload_bytes: float, group_size: int, world_size: int) -> float:
    """Bytes one node's network card sends for one collective whose group spans the nodes, under gloo (notebook 05).

    The nodes hold consecutive ranks and every group that spans nodes spans all of them (the course's meshes: the
    node is the outer dimension). In a ring each rank sends to the next rank of its group, so in each group exactly
    one rank per node sends to another node, and a node's ranks belong to ``world_size / group_size`` such
    groups: the card carries that many ranks' sends (DDP and FULL_SHARD over the whole world: one; HSDP's
    replicas on 2 nodes of 2: two). Headers and acknowledgements come on top (a few percent, measured)."""
    return world_size / group_size * GLOO_FACTOR[kind](group_size) * payload_bytes


def _check(psi, n) -> None:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise CourseInputError(f"the number of ranks N must be a whole number >= 1, got {n!r}")
    if not psi >= 0:
        raise CourseInputError(f"Ψ (elements) must be >= 0, got {psi!r}")


def reduce_scatter_sent(psi: float, n: int) -> float:
    """Elements one rank sends in a ring reduce-scatter of Ψ elements: (N−1)/N · Ψ (notebook 02)."""
    _check(psi, n)
    return (n - 1) / n * psi


def all_gather_sent(psi: float, n: int) -> float:
    """Elements one rank sends in a ring all-gather whose output has Ψ elements: (N−1)/N · Ψ (notebook 02)."""
    _check(psi, n)
    return (n - 1) / n * psi


def all_reduce_sent(psi: float, n: int) -> float:
    """Elements one rank sends in a ring all-reduce of Ψ elements: 2(N−1)/N · Ψ, the paper's "2Ψ" (notebook 02)."""
    return reduce_scatter_sent(psi, n) + all_gather_sent(psi, n)


def step_sent(strategy, psi: float, nproc: int, node_size: int | None = None) -> float:
    """Elements one rank sends per training step, by the paper's ring formulas, no padding (notebook 02).

    ``strategy``: a row of the record (``strategies.get("zero2")``); every collective it issues in a
    step moves Ψ elements (a "grad_shard", already reduce-scattered over the shard group, Ψ/Nd) over
    its mesh dimension's group, for N = ``nproc`` ranks in nodes of ``node_size`` (2-D meshes; one
    node when left out). 2(N−1)/N · Ψ for DDP and ZeRO stages 1, 2; 3(N−1)/N · Ψ for stage 3 (the
    paper's 2Ψ vs 3Ψ); HYBRID_SHARD: stage 3 inside a node of n ranks plus an all-reduce of the
    Ψ/n-element shard across the N/n nodes.
    """
    _check(psi, nproc)
    if not hasattr(strategy, "collectives"):
        raise CourseInputError(f"step_sent takes a row of the record, e.g. strategies.get('zero2'), not {strategy!r}")
    shape, names = strategy.mesh_shape(nproc, node_size or nproc)
    sizes = dict(zip(names, shape))
    shard = strategy.shard_group_size(nproc, node_size or nproc)
    return sum(
        RING_FACTOR[c.kind](sizes.get(c.over, 1)) * (psi / shard if c.of == "grad_shard" else psi)
        for c in strategy.collectives
    )


@dataclass
class RingTrace:
    """What ``ring_all_reduce`` did (notebook 02).

    Attributes:
        result: each rank's array after the all-reduce (all equal to the sum).
        sent: elements each rank sent, ``sent_reduce_scatter + sent_all_gather``.
        messages: one dict per message: phase, step, src, dst, chunk index, elements.
    """

    result: list
    sent: list
    sent_reduce_scatter: list
    sent_all_gather: list
    messages: list = field(default_factory=list)


def ring_all_reduce(inputs) -> RingTrace:
    """Sum N ranks' arrays with the ring algorithm, message by message (notebook 02).

    The Ψ elements are cut into N chunks (sizes differ by at most one). Ranks sit in a ring;
    at every step each rank sends one chunk to its right neighbour, all at once.

    1. Reduce-scatter, N−1 steps: rank r sends chunk (r − step) mod N, and the receiver adds it
       to its own copy. Afterwards rank r holds the full sum of chunk (r + 1) mod N.
    2. All-gather, N−1 steps: rank r passes on the finished chunk (r + 1 − step) mod N, and the
       receiver overwrites its copy. Afterwards every rank holds every summed chunk.

    Each rank sends N−1 chunks per phase, so 2(N−1)/N · Ψ elements when N divides Ψ.
    """
    bufs = [np.array(x, dtype=np.float64).reshape(-1).copy() for x in inputs]
    n = len(bufs)
    if n < 1 or len({b.size for b in bufs}) != 1:
        raise CourseInputError("ring_all_reduce needs one array per rank, all of the same length")
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(bufs[0].size), n)])
    chunk = lambda b, c: b[bounds[c] : bounds[c + 1]]  # noqa: E731  (a view: writes go into b)
    sent = {"reduce_scatter": [0] * n, "all_gather": [0] * n}
    messages = []
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            shift = 0 if phase == "reduce_scatter" else 1
            outgoing = [(r, (r + shift - step) % n) for r in range(n)]
            payloads = [chunk(bufs[r], c).copy() for r, c in outgoing]  # everyone sends at once
            for (src, c), data in zip(outgoing, payloads):
                dst = (src + 1) % n
                target = chunk(bufs[dst], c)
                if phase == "reduce_scatter":
                    target += data
                else:
                    target[:] = data
                sent[phase][src] += data.size
                messages.append(
                    {"phase": phase, "step": step, "src": src, "dst": dst, "chunk": c, "elements": int(data.size)}
                )
    total = [a + b for a, b in zip(sent["reduce_scatter"], sent["all_gather"])]
    return RingTrace(
        result=bufs,
        sent=total,
        sent_reduce_scatter=sent["reduce_scatter"],
        sent_all_gather=sent["all_gather"],
        messages=messages,
    )


#: gloo/transport/tcp/pair.h, ``struct Op``: every message gloo's TCP transport writes starts with six size_t.
GLOO_OP_PREAMBLE_BYTES = 6 * 8
#: gloo/allreduce.h, ``AllreduceOptionsImpl::kMaxSegmentSize``: the ring cuts a buffer into segments of at most 1 MiB.
GLOO_MAX_SEGMENT_BYTES = 1024 * 1024


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def gloo_ring_plan(total_bytes: int, n: int, rank: int, element_bytes: int = 4) -> dict:
    """What gloo's ring all-reduce makes ``rank`` write to its sockets, read from gloo's source (notebook 02).

    A transcription of ``ring()`` in gloo/allreduce.cc (the algorithm torch's ProcessGroupGloo runs for a
    dense CPU all-reduce): the buffer is cut into ``roundUp(max(ceil(B / 1 MiB), 2N), N)`` segments; each
    phase (reduce-scatter, then all-gather) runs ``segments − segments/N`` iterations, each posting one
    receive from a neighbour and one send to the other (skipped where a segment is empty). In gloo's TCP
    transport (gloo/transport/tcp/pair.cc) a send writes a NOTIFY_SEND_READY op and the data op, a receive
    writes a NOTIFY_RECV_READY op, each with a 48-byte preamble. Nothing measured: ``data`` is the payload
    bytes this rank sends (the ring's 2(N−1)/N · B when B divides evenly), ``headers`` the preambles,
    ``wire`` their sum, ``steps`` the ring steps (2(N−1)), ``segments`` and ``sends``.
    """
    _check(total_bytes, n)
    max_seg = element_bytes * max(1, GLOO_MAX_SEGMENT_BYTES // element_bytes)
    segments = _round_up(max(math.ceil(total_bytes / max_seg), 2 * n), n)
    per_rank = segments // n
    seg = _round_up(math.ceil(total_bytes / segments), element_bytes)
    span = segments * seg
    sends = recvs = data = 0
    for send_from, recv_from in ((rank + 1, rank + 2), (rank, rank + 1)):  # reduce-scatter, then all-gather
        for i in range(segments - per_rank):
            send_off = ((send_from * per_rank + i) * seg) % span
            recv_off = ((recv_from * per_rank + i) * seg) % span
            send_len = min(seg, total_bytes - send_off)
            if send_len > 0:
                sends, data = sends + 1, data + send_len
            recvs += total_bytes - recv_off > 0
    headers = GLOO_OP_PREAMBLE_BYTES * (2 * sends + recvs)
    return {
        "segments": segments,
        "segment_bytes": seg,
        "sends": sends,
        "recvs": recvs,
        "steps": 2 * (n - 1),
        "data": data,
        "headers": headers,
        "wire": data + headers,
    }
