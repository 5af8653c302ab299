"""Stage 3, step by step: the schedule of the annotated ZeRO paper's §7 as a pure state machine (notebook 03).

The picture: Nd GPUs (rows) and the model's L = Nd layers (columns). As in the course's code
(``zero.FlatParams``: rank r owns slice r of every unit), every layer is cut into Nd slices and
GPU g keeps slice g of *every* layer. Each press of Step moves the schedule on:

- forward, layer 0 to L-1: the layer is all-gathered from its Nd slices (every GPU holds it
  whole and computes it on its own part of the batch), then the gathered copies are freed;
- backward, layer L-1 to 0: the layer is gathered again, its gradients computed and
  reduce-scattered (each GPU receives the sum over GPUs of its own slice's gradients), and the
  gathered copies freed.

Each GPU's traffic is counted in units of Ψ with the ring model the course uses everywhere
(``instrument.CommCounter``): an all-gather or reduce-scatter of a layer of Ψ/L parameters
costs every GPU (Nd-1)/Nd·Ψ/L sent. After the last step each GPU has sent 3(Nd-1)/Nd·Ψ against
plain data parallelism's 2(Nd-1)/Nd·Ψ: 1.5x. At no moment does a GPU hold more than its own
slices (Ψ/Nd) plus the rest of one gathered layer.

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
        layer: the layer (= column) this step works on, None at the start and end.
        action: "gather", "drop", "reduce" or "" (start/done).
        held: ``held[gpu][layer]`` is "slice" (only its own 1/Nd of the layer) or "whole" (gathered).
        grads: ``grads[layer]`` is True once that layer's gradients have been reduce-scattered, every
            GPU holding the summed gradients of its own slice.
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

    def held_psi(self, gpu: int) -> float:
        """The fraction of Ψ GPU ``gpu`` holds right now: 1/Nd of every layer, or a whole gathered layer."""
        layers = len(self.held[gpu])
        return sum((1.0 if h == "whole" else 1.0 / self.nd) / layers for h in self.held[gpu])


def stage3_schedule(nd: int = 4) -> list[Stage3State]:
    """Every state of one training step of stage 3 on Nd GPUs with Nd layers, start to end (notebook 03).

    Returns ``4·Nd + 2`` states: the start, two per layer in the forward pass (gather, free),
    two per layer in the backward pass (gather; reduce-scatter and free), and the end.
    """
    if not isinstance(nd, int) or isinstance(nd, bool) or nd < 2:
        raise CourseInputError(f"the stage-3 stepper needs a whole number of GPUs >= 2, got {nd!r}")
    layers = nd
    per_layer = (nd - 1) / nd / layers  # Ψ units each GPU sends for one collective on one layer
    held = [["slice"] * layers for _ in range(nd)]
    grads = [False] * layers
    sent = [dict.fromkeys(TRAFFIC_KINDS, 0.0) for _ in range(nd)]
    states = []

    def record(phase, layer, action, caption):
        states.append(
            Stage3State(
                step=len(states),
                phase=phase,
                layer=layer,
                action=action,
                held=tuple(tuple(row) for row in held),
                grads=tuple(grads),
                sent=tuple(dict(row) for row in sent),
                caption=caption,
            )
        )

    def gather(layer, kind):
        for g in range(nd):
            held[g][layer] = "whole"
            sent[g][kind] += per_layer

    def drop(layer):
        for g in range(nd):
            held[g][layer] = "slice"

    record("start", None, "", f"Start: each of the {nd} GPUs holds only its own slice, 1/{nd} of every layer.")
    for layer in range(layers):
        gather(layer, "forward all-gather")
        record(
            "forward",
            layer,
            "gather",
            f"Forward, layer {layer}: all-gathered from its {nd} slices; every GPU computes layer {layer} "
            "on its own part of the batch.",
        )
        drop(layer)
        record("forward", layer, "drop", f"Forward, layer {layer} done: the gathered copies are freed.")
    for layer in reversed(range(layers)):
        gather(layer, "backward all-gather")
        record(
            "backward",
            layer,
            "gather",
            f"Backward, layer {layer}: gathered again to compute layer {layer}'s gradients.",
        )
        for g in range(nd):
            sent[g]["reduce-scatter"] += per_layer
        grads[layer] = True
        drop(layer)
        record(
            "backward",
            layer,
            "reduce",
            f"Backward, layer {layer}: its gradients are reduce-scattered (each GPU gets the sum of its own "
            "slice's) and the gathered copies freed.",
        )
    total = 3 * (nd - 1) / nd
    record(
        "done",
        None,
        "",
        f"Done: each GPU sent 3(Nd-1)/Nd·Ψ = {total:.3g}Ψ, against plain data parallelism's "
        f"2(Nd-1)/Nd·Ψ = {2 * (nd - 1) / nd:.3g}Ψ: 1.5x.",
    )
    return states
