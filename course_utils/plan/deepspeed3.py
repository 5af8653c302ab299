"""DeepSpeed stage 3's gathered parameters, replayed submodule by submodule (notebook 05).

Stage 3 has no units: every module gathers its own parameters in its pre-forward and pre-backward hooks and
releases them in its post hooks (``parameter_offload.py``), unless they come back soon.
``PartitionedParameterCoordinator.__params_to_release`` (DeepSpeed 0.19, ``partitioned_param_coordinator.py``)
walks the recorded trace of modules after the one being released, summing every parameter it meets, and keeps
a parameter it meets again before the sum reaches ``stage3_max_reuse_distance`` (1e9 elements by default).
Parameters at or below ``stage3_param_persistence_threshold`` (1e5 elements: the norms and biases of these
models) are never released.

The gradients: each parameter's bf16 gradient is copied into the reduce bucket (``reduce_bucket_size``, 5e8
elements) and freed (``__add_grad_to_ipg_bucket``, ``stage3.py``); a gradient that would overflow a bucket
holding anything reduces the bucket first, a ``torch.cat`` copy of it while it is reduce-scattered
(``reduce_scatter_coalesced``); one larger than the bucket is kept as it is until the next reduction.

``replay`` plays this on the course model's submodules (``models.GPT``: a fused ``qkv``, ``proj``, the MLP's
``gate``, ``fc`` and ``proj``, the norms; the head after ``ln_f``), in the trace a step records: the forward,
then the backward in reverse, each block the policy rebuilds running its forward again just before its
backward (its hooks fire again). ``tests/test_deepspeed.py`` holds it against DeepSpeed itself, parameter by
parameter. Not replayed: the prefetcher (the ``prefetch bucket`` term of the states: up to 5e7 elements
gathered ahead; its rule that keeps a parameter whose next use it skipped is inside the 1e9 walk).
"""

from __future__ import annotations

import functools

from .activations import rebuilt_blocks
from .shapes import Shape

DS_REDUCE_BUCKET = 5e8  # elements: reduce_bucket_size's default (deepspeed/runtime/zero/config.py)
DS_PREFETCH = 5e7  # elements: stage3_prefetch_bucket_size's default
DS_REUSE = 1e9  # elements: stage3_max_reuse_distance's default
DS_PERSIST = 1e5  # elements: stage3_param_persistence_threshold's default
#: The planner's moments ``replay`` prices, in the order of a step (``throughput.memory``'s, and one more)
MOMENTS = ("end of forward", "backward of the loss", "first block's backward", "late backward", "end of backward")


def submodules(s: Shape) -> list[tuple[str, tuple[tuple[str, int], ...]]]:
    """The course model's leaf modules in forward order, each with its parameters (name, elements); a tied
    head names the embeddings' weight."""
    h, kv, f, gpt2 = s.width, s.kv_width, s.hidden, s.arch == "gpt2"

    def linear(name, n_in, n_out, bias=gpt2):
        return name, ((f"{name}.weight", n_in * n_out),) + (((f"{name}.bias", n_out),) if bias else ())

    def norm(name):
        return name, ((f"{name}.weight", h),) + (((f"{name}.bias", h),) if gpt2 else ())

    mods = [("tok_emb", (("tok_emb.weight", s.vocab * h),))]
    if gpt2:
        mods.append(("pos_emb", (("pos_emb.weight", s.seq * h),)))
    for i in range(s.layers):
        b = f"blocks.{i}"
        mods += [norm(f"{b}.ln1"), linear(f"{b}.attn.qkv", h, h + 2 * kv), linear(f"{b}.attn.proj", h, h)]
        mods.append(norm(f"{b}.ln2"))
        if not gpt2:
            mods.append(linear(f"{b}.mlp.gate", h, f))
        mods += [linear(f"{b}.mlp.fc", h, f), linear(f"{b}.mlp.proj", f, h)]
    mods.append(norm("ln_f"))
    mods.append(("head", (("tok_emb.weight" if s.tied else "head.weight", s.vocab * h),)))
    return mods


def trace(s: Shape, policy: str) -> list[tuple[str, str, tuple, bool, bool]]:
    """(pass, module, parameters, fetches, releases) in the order the hooks fire: "forward", then "backward",
    "recompute" where the policy runs a block again. A block run again starts its backward with its last
    module's pre-backward hook (the gradient reaches that module's output first); its matmul's backward then
    unpacks a saved tensor, which runs the block's forward again (torch's non-reentrant checkpoint), up to the
    last tensor it saves, inside that same last module: there the recomputation stops early
    (``_StopRecomputationError``, ``torch/utils/checkpoint.py``), before that module's post-forward hook."""
    mods = submodules(s)
    first = 2 if s.arch == "gpt2" else 1
    per = (len(mods) - first - 2) // s.layers
    blocks = [mods[first + i * per : first + (i + 1) * per] for i in range(s.layers)]
    out = [("forward", *m, True, True) for m in mods]
    out += [("backward", *m, True, True) for m in mods[:-3:-1]]  # the head, then ln_f
    # a rebuilt block runs its forward again; so does every block under "selective" (the saved matmul outputs
    # are read from a cache, but each module is called again, and its hooks fire)
    rerun = (True,) * s.layers if policy == "selective" else rebuilt_blocks(policy, s.layers)
    for block, again in reversed(list(zip(blocks, rerun))):
        if again:
            *rest, last = block
            out.append(("backward", *last, True, False))
            out += [("recompute", *m, True, True) for m in rest] + [("recompute", *last, True, False)]
            out.append(("backward", *last, False, True))
            out += [("backward", *m, True, True) for m in reversed(rest)]
        else:
            out += [("backward", *m, True, True) for m in reversed(block)]
    out += [("backward", *m, True, True) for m in reversed(mods[:first])]
    return out


@functools.lru_cache(maxsize=256)
def replay(s: Shape, policy: str, reuse: float = DS_REUSE, bucket: float = DS_REDUCE_BUCKET,
           persist: float = DS_PERSIST) -> dict:  # fmt: skip
    """Stage 3's gathered parameters and transient gradients, module by module, on one step's trace.

    Returns ``forward_end`` (the parameter names gathered when the head's forward has ended: the loss comes
    next), ``at_backward`` (module -> the names gathered while its gradient is made; the last occurrence),
    ``flushes`` (the elements in the bucket at each of its reductions, the epilogue's last),
    and the bytes beyond the states (bf16: gathered parameters, the gradient being made, gradients kept
    because they did not fit a bucket, a bucket's ``torch.cat`` copy while it is reduced) at the planner's
    moments: ``end of forward``, ``backward of the loss`` (the head's), ``first block's backward`` (the last
    block's, its recomputation included), ``late backward`` (the most over the other blocks) and ``end of
    backward`` (the embeddings' backward, then the epilogue's reduction of what is left in the bucket)."""
    t = trace(s, policy)
    size = {p: n for _, _, params, _, _ in t for p, n in params}
    kept_always = {p for p, n in size.items() if n <= persist}
    available: set = set()
    in_bucket = 0.0
    held: dict = {}  # oversized gradients, kept to the next reduction
    flushes = []  # elements in the bucket at each reduction, in order
    out = {"at_backward": {}, **dict.fromkeys(MOMENTS, 0.0)}
    last_block = f"blocks.{s.layers - 1}."

    def gathered_bytes() -> float:
        return 2.0 * sum(size[p] for p in available if p not in kept_always)

    def release(j: int, params) -> None:
        # __params_to_release: the modules fetched after this point, until 1e9 elements have been walked
        ids = {p for p, _ in params} - kept_always
        walked = 0.0
        for _, _, nxt, fetches, _ in t[j + 1 :]:
            if walked >= reuse or not ids:
                break
            for p, n in nxt if fetches else ():
                ids.discard(p)
                walked += n
        available.difference_update(ids)

    for j, (kind, name, params, _, releases) in enumerate(t):
        available.update(p for p, _ in params)
        if kind == "backward" and releases:  # its gradient is made, then its post-backward hook
            out["at_backward"][name] = frozenset(available)
            grad = sum(n for _, n in params)
            cat = 0.0
            if in_bucket and in_bucket + grad > bucket:  # the bucket is reduced first: its cat copy
                flushes.append(in_bucket)
                cat, in_bucket = 2.0 * in_bucket, 0.0
                held.clear()
            here = gathered_bytes() + 2.0 * grad + cat + 2.0 * sum(held.values())
            in_bucket += grad
            if grad > bucket:
                held[name] = grad
            moment = ("backward of the loss" if name in ("head", "ln_f")
                      else "first block's backward" if name.startswith(last_block)
                      else "late backward" if name.startswith("blocks.") else "end of backward")  # fmt: skip
            out[moment] = max(out[moment], here)
        if releases:
            release(j, params)
        if kind == "forward" and name == "head":
            out["forward_end"] = frozenset(available)
            out["end of forward"] = gathered_bytes()
    # the backward's epilogue reduces what is left in the bucket: its cat copy
    out["end of backward"] = max(out["end of backward"], gathered_bytes() + 2.0 * in_bucket)
    out["flushes"] = tuple(flushes + [in_bucket])
    return out


def kept_words(s: Shape, names) -> str:
    """What a set of gathered parameter names holds, in words (notebook 05): "the head, block 38's mlp.proj,
    block 39 (whole)"; the norms (never released) left out."""
    matrices = {m.split(".", 2)[2] for m, _ in submodules(s)[:-2] if m.startswith("blocks.0.") and ".ln" not in m}
    blocks: dict = {}
    for name in names:
        if name.startswith("blocks.") and ".ln" not in name:
            _, i, module = name.rsplit(".", 1)[0].split(".", 2)
            blocks.setdefault(int(i), set()).add(module)
    words = ["the head"] if ("tok_emb.weight" if s.tied else "head.weight") in names else []
    for i, mods in sorted(blocks.items()):
        words.append(f"block {i} (whole)" if mods == matrices else f"block {i}'s {', '.join(sorted(mods))}")
    return ", ".join(words)
