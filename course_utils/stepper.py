"""Stage 3, step by step: the schedule of the annotated ZeRO paper's §7 as a pure state machine (notebook 03).

The picture: Nd GPUs (rows) and the model's parameters cut into Nd shards (columns), one per
layer, GPU i owning shard i and nothing else. Each press of Step moves the schedule on:

- forward, layer 0 to L-1: the layer's shard is all-gathered (every GPU borrows a copy and
  computes the layer on its own part of the batch), then the borrowed copies are dropped;
- backward, layer L-1 to 0: the shard is gathered again, the layer's gradients are computed,
  reduce-scattered (summed onto the owner) and the borrowed copies dropped.

Each GPU's traffic is counted in units of Ψ with the ring model the course uses everywhere
(``instrument.CommCounter``): an all-gather or reduce-scatter of a layer of Ψ/L parameters
costs every GPU (Nd-1)/Nd·Ψ/L sent. After the last step each GPU has sent 3(Nd-1)/Nd·Ψ against
plain data parallelism's 2(Nd-1)/Nd·Ψ: 1.5x. At no moment does a GPU hold more than its own
shard plus one borrowed layer.

The widget (``widgets.zero3_stepper``) and the figure (``plots.zero3_schedule_figure``) only
draw these states; nothing here imports torch or matplotlib.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import CourseInputError

#: The three kinds of traffic a GPU does in stage 3, in the order the bars stack them.
TRAFFIC_KINDS = ("forward all-gather", "backward all-gather", "reduce-scatter")


@dataclass(frozen=True)
class Stage3State:
    """One moment of the stage-3 schedule (notebook 03).

    Attributes:
        step: 0 before the forward pass, then 1, 2, ... up to ``4·L + 1`` (the end).
        phase: "start", "forward", "backward" or "done".
        layer: the layer (= shard = column) this step works on, None at the start and end.
        action: "gather", "drop", "reduce" or "" (start/done).
        held: ``held[gpu][shard]`` is "own", "borrowed" or "".
        grads: ``grads[shard]`` is True once that shard's gradients have been summed onto its owner.
        sent: per GPU, ``{kind: Ψ units sent so far}`` for each kind in ``TRAFFIC_KINDS``.
        caption: one sentence saying what just happened.
    """

    step: int
    phase: str
    layer: int | None
    action: str
    held: tuple
    grads: tuple
    sent: tuple
    caption: str

    @property
    def nd(self) -> int:
        return len(self.held)

    def sent_total(self, gpu: int) -> float:
        """Ψ units GPU ``gpu`` has sent so far, all kinds together."""
        return sum(self.sent[gpu].values())

    def shards_held(self, gpu: int) -> int:
        """How many shards GPU ``gpu`` holds right now (its own one plus any borrowed)."""
        return sum(1 for h in self.held[gpu] if h)


def stage3_schedule(nd: int = 4) -> list[Stage3State]:
    """Every state of one training step of stage 3 on Nd GPUs with Nd layers, start to end (notebook 03).

    Returns ``4·Nd + 2`` states: the start, two per layer in the forward pass (gather, drop),
    two per layer in the backward pass (gather; reduce-scatter and drop), and the end.
    """
    if not isinstance(nd, int) or isinstance(nd, bool) or nd < 2:
        raise CourseInputError(f"the stage-3 stepper needs a whole number of GPUs >= 2, got {nd!r}")
    layers = nd
    per_layer = (nd - 1) / nd / layers  # Ψ units each GPU sends for one collective on one layer
    held = [["own" if g == s else "" for s in range(layers)] for g in range(nd)]
    grads = [False] * layers
    sent = [dict.fromkeys(TRAFFIC_KINDS, 0.0) for _ in range(nd)]
    states = []

    def record(phase, layer, action, caption):
        states.append(Stage3State(
            step=len(states), phase=phase, layer=layer, action=action,
            held=tuple(tuple(row) for row in held), grads=tuple(grads),
            sent=tuple(dict(row) for row in sent), caption=caption))

    def borrow(layer, kind):
        for g in range(nd):
            if g != layer:
                held[g][layer] = "borrowed"
            sent[g][kind] += per_layer

    def drop(layer):
        for g in range(nd):
            if g != layer:
                held[g][layer] = ""

    record("start", None, "", f"Start: each of the {nd} GPUs holds only its own shard (1/{nd} of every model state).")
    for layer in range(layers):
        borrow(layer, "forward all-gather")
        record("forward", layer, "gather",
               f"Forward, layer {layer}: GPU {layer}'s shard is all-gathered; every GPU computes layer {layer} "
               "on its own part of the batch.")
        drop(layer)
        record("forward", layer, "drop", f"Forward, layer {layer} done: the borrowed copies are dropped.")
    for layer in reversed(range(layers)):
        borrow(layer, "backward all-gather")
        record("backward", layer, "gather",
               f"Backward, layer {layer}: the shard is gathered again to compute layer {layer}'s gradients.")
        for g in range(nd):
            sent[g]["reduce-scatter"] += per_layer
        grads[layer] = True
        drop(layer)
        record("backward", layer, "reduce",
               f"Backward, layer {layer}: its gradients are reduce-scattered (summed onto GPU {layer}) and the "
               "borrowed copies dropped.")
    total = 3 * (nd - 1) / nd
    record("done", None, "", f"Done: each GPU sent 3(Nd-1)/Nd·Ψ = {total:.3g}Ψ, against plain data parallelism's "
                             f"2(Nd-1)/Nd·Ψ = {2 * (nd - 1) / nd:.3g}Ψ: 1.5x.")
    return states


class Stage3Stepper:
    """The schedule as a state machine: ``step()``, ``back()``, ``reset()``, ``state`` (notebook 03).

    ``step()`` at the end and ``back()`` at the start leave the state where it is.
    """

    def __init__(self, nd: int = 4):
        self.states = stage3_schedule(nd)
        self.index = 0

    @property
    def state(self) -> Stage3State:
        return self.states[self.index]

    @property
    def done(self) -> bool:
        return self.index == len(self.states) - 1

    def step(self) -> Stage3State:
        self.index = min(self.index + 1, len(self.states) - 1)
        return self.state

    def back(self) -> Stage3State:
        self.index = max(self.index - 1, 0)
        return self.state

    def reset(self) -> Stage3State:
        self.index = 0
        return self.state

    def last(self) -> Stage3State:
        self.index = len(self.states) - 1
        return self.state
