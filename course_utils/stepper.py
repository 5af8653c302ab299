"""Stage 3, step by step: the schedule of the annotated ZeRO paper's §7 as a pure state machine (notebook 03).

The picture: Nd GPUs (rows) and the model's units (columns): L = Nd layers and the root unit (every
parameter outside the layers: embeddings, final norm, the tied head). As in the course's code
(``zero.Zero3Module``: rank r owns slice r of every unit), every unit is cut into Nd slices and GPU g
keeps slice g of *every* unit. Each press of Step moves the schedule on:

- forward: the root is all-gathered and stays whole to the end of the forward; layer 0 to L-1 each
  all-gathered from its Nd slices (every GPU holds it whole and computes it on its own part of the
  batch), then freed; the root freed after the head;
- backward: the root gathered again (the head's gradients come first); layer L-1 to 0 each gathered
  again, its gradients computed and reduce-scattered (each GPU receives the sum over GPUs of its own
  slice's gradients), and freed; the root's gradients reduce-scattered last (the embedding's).

Each GPU's traffic is counted in units of Ψ with the ring model the course uses everywhere
(``instrument.CommCounter``): the picture draws its L + 1 units (the layers and the root) the same
size, Ψ/(L+1) parameters each, and an all-gather or reduce-scatter of one costs every GPU (Nd-1)/Nd
of that unit's Ψ sent. After the last step each GPU has sent 3(Nd-1)/Nd·Ψ
against plain data parallelism's 2(Nd-1)/Nd·Ψ: 1.5x. At no moment does a GPU hold more than its own
slices (Ψ/Nd) plus the rest of the root and of one gathered layer: 2(Nd-1)/(Nd(L+1))·Ψ more, in the
picture's equal units (a real model's root and layers differ in size).

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
        layer: the unit (= column: a layer, or ``nd`` for the root) this step works on, None at the start and end.
        action: "gather", "drop", "reduce" or "" (start/done).
        held: ``held[gpu][unit]`` is "slice" (only its own 1/Nd of the unit) or "whole" (gathered).
        grads: ``grads[unit]`` is True once that unit's gradients have been reduce-scattered, every
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
        """The fraction of Ψ GPU ``gpu`` holds right now: 1/Nd of every unit, or a whole gathered unit."""
        layers = len(self.held[gpu])
        return sum((1.0 if h == "whole" else 1.0 / self.nd) / layers for h in self.held[gpu])


def column_labels(nd: int) -> list[str]:
    """The columns of the picture: the Nd layers (blocks), then the root unit (notebook 03)."""
    return [f"layer {i}" for i in range(nd)] + ["root"]


def stage3_schedule(nd: int = 4) -> list[Stage3State]:
    """Every state of one training step of stage 3 on Nd GPUs with Nd layers and a root unit, start to end (notebook 03).

    The root unit is every parameter outside the layers (embeddings, final norm, the tied head), one unit as in
    the course's ``zero.Zero3Module`` and in FSDP: gathered before the first layer's forward and kept whole to the
    end of the forward (the head runs last), gathered again when the backward starts (the head's gradients come
    first) and reduce-scattered last (the embedding's gradients come last). Here it is drawn the size of one layer.

    Returns ``4·Nd + 6`` states: the start, the root gathered, two per layer in the forward pass (gather,
    free), the root freed, the root gathered again, two per layer in the backward pass (gather;
    reduce-scatter and free), the root reduce-scattered and freed, and the end.
    """
    if not isinstance(nd, int) or isinstance(nd, bool) or nd < 2:
        raise CourseInputError(f"the stage-3 stepper needs a whole number of GPUs >= 2, got {nd!r}")
    layers, root = nd, nd  # columns 0..nd-1 are the layers, column nd the root unit
    units = layers + 1
    per_unit = (nd - 1) / nd / units  # Ψ units each GPU sends for one collective on one unit (each Ψ/(L+1))
    held = [["slice"] * units for _ in range(nd)]
    grads = [False] * units
    sent = [dict.fromkeys(TRAFFIC_KINDS, 0.0) for _ in range(nd)]
    states = []
    name = column_labels(nd)

    def record(phase, unit, action, caption):
        states.append(
            Stage3State(
                step=len(states),
                phase=phase,
                layer=unit,
                action=action,
                held=tuple(tuple(row) for row in held),
                grads=tuple(grads),
                sent=tuple(dict(row) for row in sent),
                caption=caption,
            )
        )

    def gather(unit, kind):
        for g in range(nd):
            held[g][unit] = "whole"
            sent[g][kind] += per_unit

    def drop(unit):
        for g in range(nd):
            held[g][unit] = "slice"

    def reduce(unit):
        for g in range(nd):
            sent[g]["reduce-scatter"] += per_unit
        grads[unit] = True
        drop(unit)

    record("start", None, "", f"Start: each of the {nd} GPUs holds only its own slice, 1/{nd} of every unit.")
    gather(root, "forward all-gather")
    record(
        "forward",
        root,
        "gather",
        "Forward: the root unit (embeddings, final norm, head) is all-gathered first and stays whole: "
        "the embedding runs before the first layer, the head after the last.",
    )
    for layer in range(layers):
        gather(layer, "forward all-gather")
        record(
            "forward",
            layer,
            "gather",
            f"Forward, {name[layer]}: all-gathered from its {nd} slices; every GPU computes it "
            "on its own part of the batch.",
        )
        drop(layer)
        record("forward", layer, "drop", f"Forward, {name[layer]} done: the gathered copies are freed.")
    drop(root)
    record("forward", root, "drop", "Forward done: the head has run, and the root's gathered copies are freed too.")
    gather(root, "backward all-gather")
    record("backward", root, "gather", "Backward: the root is gathered again, for the head's gradients first.")
    for layer in reversed(range(layers)):
        gather(layer, "backward all-gather")
        record(
            "backward",
            layer,
            "gather",
            f"Backward, {name[layer]}: gathered again to compute its gradients, beside the whole root.",
        )
        reduce(layer)
        record(
            "backward",
            layer,
            "reduce",
            f"Backward, {name[layer]}: its gradients are reduce-scattered (each GPU gets the sum of its own "
            "slice's) and the gathered copies freed.",
        )
    reduce(root)
    record(
        "backward",
        root,
        "reduce",
        "Backward, root: the embedding's gradients come last; the root's are reduce-scattered and its copies freed.",
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
