"""One replica group of a TorchFT run: its process, ``replica_main`` (notebook 06).

``course_utils.ft.ft_run`` launches ``ft_jobs.job_manager`` as one ``course_utils.launch`` worker; it forks
the lighthouse and one process per replica group (``replica_main``, here) and restarts a group that dies.
The groups and the job manager talk through files in the run's folder: each group's event log
(``events-R-A.jsonl``, one JSON line per step try), and markers (``ready-R``, ``done-R``, ``dead-R``,
``gone-R``, ``asking-R-A``, ``holding``) that say who is where. What a run is: ``ft_config.FTConfig``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

from . import ft_nodes
from .ft_config import FTConfig


def _adam_state(model, optimizer) -> dict:
    """Adam's state by parameter name: both moments and the step count, what a heal must copy."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        f"{key}.{names[id(p)]}": value
        for p, state in optimizer.state.items()
        for key, value in state.items()
        if hasattr(value, "dim")
    }


def _holding(run_dir: Path, cfg: FTConfig, participants: int) -> bool:
    """A dead group is being restarted and has not rejoined: the survivors' last steps wait for it."""
    gone = sum((run_dir / f"gone-{r}").exists() for r in range(cfg.replicas))
    return participants < cfg.replicas - gone and cfg.restart_after is not None


def replica_main(cfg: FTConfig, replica: int, attempt: int, place: dict, lighthouse: str, run_dir: Path) -> None:
    """One replica group's training with torchft, through the course's one loop (notebook 06).

    The loop is ``loop.run_steps`` with torchft's pieces in it. Synchronous (DDP): before each step
    the optimizer wrapper's ``zero_grad`` asks the lighthouse for a quorum (and heals this group from
    a live peer when it is behind), DDP's gradient all-reduce runs over the quorum's process group,
    and the wrapper's ``step`` applies the update only if every group's all-reduce worked
    (``should_commit``). DiLoCo: the inner Adam steps locally; after every H steps torchft's hook asks
    for a quorum, all-reduces each group's change of the weights since the last synchronisation and
    applies their mean with the outer optimizer, if ``should_commit``. The step numbers follow the
    manager's count (``_Replica.quorum_steps``): a discarded step is tried again (DiLoCo's on the next
    round's batches: ``_Replica.skipped``), and a group that healed jumps to the step its peer is at.
    """
    import torch

    from .data import batch_for_rank
    from .loop import Prepared, module_held, run_steps

    ft_nodes.enter(place)  # first: every socket below opens in this group's place
    group = _Replica(cfg, replica, attempt, place, lighthouse, run_dir)
    group.build()
    group.wait_for_every_group()
    prepared = Prepared(
        model=group.net,
        optimizer=group.update,
        full_state_dict=group.model.state_dict,
        held=lambda: module_held(group.model, group.inner),
    )
    info = SimpleNamespace(rank=replica, world_size=cfg.replicas, device=torch.device("cpu"))
    steps = group.diloco_steps() if cfg.diloco else group.quorum_steps()
    kw = dict(batch=cfg.batch, seq=group.model.cfg.seq, vocab=group.model.cfg.vocab, seed=cfg.seed)

    def data(s, r, w):  # group.skipped read at each step: a discarded DiLoCo round's retry takes new batches
        return batch_for_rank(s + group.skipped * cfg.sync_every, r, w, **kw)

    run_steps(prepared, cfg.train_config(), info, steps, [_committed(group)], data=data)
    group.finish()


class _Replica:
    """What one replica group holds and does: its model and optimizers, torchft's manager (timed), the
    planned failure, its event log, and the step numbers it trains (``replica_main``, notebook 06)."""

    def __init__(self, cfg: FTConfig, replica: int, attempt: int, place: dict, lighthouse: str, run_dir: Path):
        self.cfg, self.replica, self.attempt, self.place = cfg, replica, attempt, place
        self.lighthouse, self.run_dir = lighthouse, run_dir
        self.counting = place.get("ns") is not None  # a node's cable; loopback carries the whole machine's traffic
        self.kill = cfg.kill_at() if attempt == 0 else None
        self.hang = next(iter(cfg.planned("hang")), None) if attempt == 0 else None
        self.healed: list[float] = []  # seconds of each heal's copy from a live peer
        self.skipped = 0  # DiLoCo: rounds discarded, whose retries move on to new batches (``diloco_steps``)
        self.timed = {"quorum": [], "commit": []}  # TorchFT's own cost per call
        self.clock: dict = {}
        self.events = open(run_dir / f"events-{replica}-{attempt}.jsonl", "w")

    def record(self, **row) -> None:
        self.events.write(json.dumps({"replica": self.replica, "attempt": self.attempt, **row}) + "\n")
        self.events.flush()

    def build(self) -> None:
        """The model, Adam, this group's process group and torchft's manager; then the strategy's wrappers."""
        import torch

        from .loop import make_optimizer
        from .models import build_model, get_config

        cfg, place = self.cfg, self.place
        cores = len(place["cores"]) if place.get("cores") else (os.cpu_count() or 1) // cfg.replicas
        torch.set_num_threads(max(1, cores))  # R processes on a few cores, as course_utils.dist.init splits them
        self.model = build_model(get_config(cfg.model), seed=cfg.seed)  # every group the same weights (no init_sync)
        self.inner = make_optimizer(self.model.parameters(), cfg.train_config())
        self.manager = self._manager()
        self._time_manager_calls()
        if self.kill and self.kill[0] == self.replica and cfg.during_allreduce:
            self._die_in_allreduce()
        self._wrap()

    def _manager(self):
        from datetime import timedelta

        import torch
        import torchft
        from torchft.checkpointing.pg_transport import PGTransport

        cfg, place, model, inner = self.cfg, self.place, self.model, self.inner
        store = ft_nodes.bound_store(place["addr"])  # one process per group: the group's own store is local
        pg = ft_nodes.process_group(place["addr"], timeout=timedelta(seconds=10))
        transport = PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu"))
        recv = transport.recv_checkpoint

        def timed_recv(*args, **kwargs):  # heal_s: the copy from the live peer, timed where it happens
            t0 = time.perf_counter()
            state = recv(*args, **kwargs)
            self.healed.append(time.perf_counter() - t0)
            return state

        transport.recv_checkpoint = timed_recv
        ft_nodes.bind_manager_server(place["addr"])
        return torchft.Manager(
            pg=pg,
            min_replica_size=1,
            state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
            load_state_dict=lambda sd: (
                model.load_state_dict(sd["model"]),
                inner.load_state_dict(sd["optim"]) if cfg.heal_optimizer else None,
            ),
            replica_id=f"replica{self.replica}",
            lighthouse_addr=self.lighthouse,
            hostname=place["addr"],
            store_addr=place["addr"],
            store_port=store.port,
            rank=0,
            world_size=1,
            # Synchronous quorum: a group that heals loads the peer's state before its forward pass and
            # takes a full part in that same step (torchft's default overlaps the quorum with forward;
            # DiLoCo requires it synchronous).
            use_async_quorum=False,
            init_sync=False,
            checkpoint_transport=transport,
            timeout=timedelta(seconds=10),
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s or cfg.timeout_s),
            connect_timeout=timedelta(seconds=10),
        )

    def _time_manager_calls(self) -> None:
        for name, method in (("quorum", "start_quorum"), ("commit", "should_commit")):
            real = getattr(self.manager, method)

            def timed_call(*args, _real=real, _list=self.timed[name], _name=name, **kwargs):
                if _name == "quorum" and self.attempt > 0:  # a restarted group asks to join: the others may go on
                    (self.run_dir / f"asking-{self.replica}-{self.attempt}").touch()
                t0 = time.perf_counter()
                out = _real(*args, **kwargs)
                _list.append(time.perf_counter() - t0)
                return out

            setattr(self.manager, method, timed_call)

    def die(self, where: str) -> None:
        """The planned kill: its event row, its ``dead-R`` marker (``_restarting``), then ``die_hard``."""
        from .failures import die_hard

        self.record(kill=self.kill[1], where=where, t=time.time())
        (self.run_dir / f"dead-{self.replica}").touch()  # before the death: before any peer can notice it
        how = "inside the all-reduce of step" if where == "allreduce" else "between steps, before step"
        die_hard(f"replica {self.replica} {how} {self.kill[1]}")

    def _die_in_allreduce(self) -> None:
        manager, cfg, kill = self.manager, self.cfg, self.kill
        allreduce = manager.allreduce

        def die_in_allreduce(tensor, *args, **kwargs):  # DDP's comm hook (DiLoCo's sync) calls manager.allreduce
            # the peers' all-reduce of this step (DiLoCo: of the round holding it) waits for our part
            if manager.current_step() == (kill[1] // cfg.sync_every if cfg.diloco else kill[1]):
                self.die("allreduce")
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = die_in_allreduce

    def _wrap(self) -> None:
        """``update`` (the loop's optimizer) and ``net`` (the module it trains): DiLoCo's or synchronous DDP's."""
        import torch
        import torchft

        cfg, model, inner = self.cfg, self.model, self.inner
        if cfg.diloco:
            from torchft.local_sgd import DiLoCo

            outer = torch.optim.SGD(model.parameters(), lr=cfg.outer_lr, momentum=0.9, nesterov=True)
            DiLoCo(
                self.manager,
                [model],
                inner,
                outer,
                sync_every=cfg.sync_every,
                backup_device=torch.device("cpu"),
                pin_memory=False,
            ).__enter__()  # hooks on the inner optimizer's step; they stay for the life of this process
            self.update, self.net = SimpleNamespace(step=inner.step, zero_grad=inner.zero_grad), model
        else:
            self.optimizer = torchft.Optimizer(self.manager, inner)
            # The loop's optimizer: torchft's step (applied only if should_commit() says every group's
            # all-reduce worked); its zero_grad only clears gradients, the quorum being quorum_steps' act.
            self.update = SimpleNamespace(step=self.optimizer.step, zero_grad=inner.zero_grad)
            self.net = torchft.DistributedDataParallel(self.manager, model)

    def wait_for_every_group(self) -> None:
        """Start together: every group is heartbeating before any asks for the first quorum."""
        run_dir, cfg = self.run_dir, self.cfg
        (run_dir / f"ready-{self.replica}").touch()
        while self.attempt == 0 and not all((run_dir / f"ready-{r}").exists() for r in range(cfg.replicas)):
            time.sleep(0.01)

    def before_step(self, step: int) -> None:
        kill, hang, replica = self.kill, self.hang, self.replica
        if kill and kill[0] == replica and not self.cfg.during_allreduce and step == kill[1]:
            self.die("between")
        if hang and hang[0] == replica and step == hang[1]:
            self.record(hang=hang[1], t=time.time())
            time.sleep(10**6)  # stuck in Python: torchft's heartbeat runs in its own (Rust) threads
        link = ft_nodes.link_bytes(self.place["iface"]) if self.counting else None
        self.clock.update(t0=time.time(), bytes0=link)

    def quorum_steps(self):
        """Synchronous: the step numbers as the manager hands them out; a step starts with its quorum."""
        manager, cfg = self.manager, self.cfg
        while manager.current_step() < cfg.steps:
            self.before_step(manager.current_step())
            while True:
                self.optimizer.zero_grad()  # the quorum for this step; heals this group here if it is behind
                late = cfg.steps - manager.current_step() <= cfg.after_heal
                if not (late and _holding(self.run_dir, cfg, manager.num_participants())):
                    break
                (self.run_dir / "holding").touch()  # tells the job manager not to wait any longer
                time.sleep(0.02)  # a quorum without a step: the restarted group joins one of these
            self.clock["quorum"] = time.time()
            step = manager.current_step()
            if self.healed:
                self.record(healed_to_step=step, heal_s=self.healed.pop(), t=self.clock["quorum"])
            if step >= cfg.steps:  # healed from a peer that had already finished
                return
            yield step

    def diloco_steps(self):
        """DiLoCo: H local steps per round; the round's last step ends in the synchronisation."""
        manager, cfg = self.manager, self.cfg
        tries, outer_step = 0, None
        while manager.current_step() * cfg.sync_every < cfg.steps:
            self.skipped += outer_step == manager.current_step()  # a discarded round: its retry takes new batches
            outer_step = manager.current_step()
            rounds_left = cfg.steps // cfg.sync_every - outer_step
            while rounds_left <= cfg.after_heal and _restarting(self.run_dir, cfg, but=self.replica):
                (self.run_dir / "holding").touch()  # tells the job manager not to wait any longer
                time.sleep(0.02)  # the last rounds wait until a restarted group is running again
            tries += 1
            for local in range(cfg.sync_every):
                step = outer_step * cfg.sync_every + local
                self.before_step(step)
                self.clock.update(
                    quorum=self.clock["t0"], round=tries, sync=local == cfg.sync_every - 1, outer=outer_step
                )
                yield step

    def finish(self) -> None:
        """Keep answering quorums (no steps) until every group has finished, then write the final line.

        So a restarted group that arrives late can still heal from a finished one (synchronous mode:
        DiLoCo's quorum is followed by an all-reduce a finished group would not join).
        """
        from .data import global_batch
        from .instrument import weights_sha256
        from .models import get_config

        cfg, manager, m = self.cfg, self.manager, get_config(self.cfg.model)
        # the final weights' loss on a batch no step trained on: DiLoCo's rows are its drifting groups' losses
        tokens = global_batch(10**6, cfg.batch, m.seq, m.vocab, cfg.seed)
        (self.run_dir / f"done-{self.replica}").touch()
        while not cfg.diloco and not _all_finished(self.run_dir, cfg):
            self.optimizer.zero_grad()
            time.sleep(0.05)
        self.record(
            final=True,
            step=manager.current_step() * (cfg.sync_every if cfg.diloco else 1),
            weights_sha256=weights_sha256(self.model.state_dict()),
            adam_sha256=weights_sha256(_adam_state(self.model, self.inner)),
            adam_steps=sorted({int(s["step"]) for s in self.inner.state.values()}),
            held_out_loss=float(self.model(tokens[:, :-1], tokens[:, 1:]).detach()),
            listening=ft_nodes.listening_addresses([os.getpid()]),
            t=time.time(),
            pid=os.getpid(),
        )
        self.events.close()
        manager.shutdown(wait=False)


def _committed_row(group: _Replica, step: int, loss: float) -> dict:
    """What the manager decided about one step, as the loop ran it: one line of the group's event log."""
    cfg, manager, clock, timed = group.cfg, group.manager, group.clock, group.timed
    row = dict(step=step, t0=clock["t0"], t1=time.time(), loss=loss)
    if group.counting:
        (rx0, tx0), (rx1, tx1) = clock["bytes0"], ft_nodes.link_bytes(group.place["iface"])
        row.update(rx=rx1 - rx0, tx=tx1 - tx0)
    if not cfg.diloco:
        row.update(
            committed=manager.current_step() > step,
            participants=manager.num_participants(),
            quorum_s=clock["quorum"] - clock["t0"],
            commit_s=timed["commit"].pop(),
        )
    elif clock["sync"]:  # the synchronisation ran inside inner.step(): quorum, all-reduce, outer step
        row.update(
            round=clock["round"],
            sync=True,
            committed=manager.current_step() > clock["outer"],
            participants=manager.num_participants(),
            quorum_s=timed["quorum"].pop(),
            commit_s=timed["commit"].pop(),
        )
        if group.healed:
            group.record(healed_to_step=manager.current_step() * cfg.sync_every, heal_s=group.healed.pop(), t=row["t1"])
            row["healed"] = True  # this round's local steps were replaced by the peer's state
    else:
        row.update(round=clock["round"])
    return row


def _committed(group: _Replica):
    """An observer of the loop that writes each step's row to the group's event log (``_committed_row``)."""
    from .instrument import Observer  # imports torch: only in the replica's own process

    class Committed(Observer):
        def after_forward(self, step, loss):
            self.loss = loss

        def after_update(self, step):
            group.record(**_committed_row(group, step, float(self.loss.detach())))

    return Committed()


def _restarting(run_dir: Path, cfg: FTConfig, but: int | None = None) -> bool:
    """A group other than ``but`` died (``dead-R``, which the dying group writes: the job manager's, after it has
    reaped the process, came late on a busy machine and the survivor finished without waiting), will be
    restarted, and its new process has not asked the lighthouse to join: it trains one round alone, then joins
    the survivors' next synchronisation. ``but``, the restarted group, must not wait for its own restart (both
    groups waited for ever when the death fell in the first round and the last rounds began at once)."""
    return cfg.restart_after is not None and any(
        (run_dir / f"dead-{r}").exists()
        and not (run_dir / f"gone-{r}").exists()
        and not (run_dir / f"asking-{r}-1").exists()
        for r in range(cfg.replicas)
        if r != but
    )


def _all_finished(run_dir: Path, cfg: FTConfig) -> bool:
    return all((run_dir / f"done-{r}").exists() or (run_dir / f"gone-{r}").exists() for r in range(cfg.replicas))
