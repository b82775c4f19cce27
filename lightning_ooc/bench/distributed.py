"""Features partitioned across machines: MassiveGNN's remote-row buffer against none.

``lightning-ooc bench distributed [ROOT]`` checks MassiveGNN's finding (Sarkar
et al., 2024: the scored prefetch/eviction buffer cuts remote requests by
15-25 % and end-to-end time by 15-40 % against no buffer). For each machine
count of ``--machines`` (2 and 4 by default) the dataset is partitioned once
(``lightning-ooc partition``); every configuration then launches one
``torch.distributed.run`` per simulated machine over loopback, each machine
with a directory holding its own part only (hard links), training GraphSAGE
with ``OutOfCoreNodeData`` under a multi-node Lightning ``Trainer`` (CPU,
gloo), once per ``remote_cache_policy`` of ``--policies``:

* ``none``: every remote row of every minibatch is asked from its owner;
* ``static``: a buffer of the highest-degree remote nodes, never replaced;
* ``scored``: the same warm start, then MassiveGNN's scored eviction and
  replacement every ``--interval`` (Delta) minibatches with decay ``--gamma``.

The buffer holds ``--remote-fraction`` (the paper's f_p^h) of the nodes the
machine does not own, converted to bytes for ``remote_cache``.

Seed order (``--orders``): ``shuffle`` is the library's default (a new random
order every epoch). ``drift`` is the setting where eviction matters: each
epoch sweeps the machine's training seeds in a locality order (by planted
community: the class of the synthetic graph, whose edges stay inside it with
probability ``homophily``; ``--locality id`` sorts by node id instead) from a
start that moves by ``--drift-step`` of the seeds every epoch, so consecutive
minibatches touch the same region and the region moves. Every seed is still
trained exactly once per epoch. It is installed by bench-local subclasses
(:class:`DriftSeedBatches`, :class:`DriftPasses`, :class:`DriftNodeData`).

Reported per configuration (each machine writes a JSON per epoch; the parent
collects them): seconds per epoch (the slowest machine; mean over the epochs
after the first, and the first), remote rows asked for per machine per
epoch, rows fetched from owners (misses plus replacements), the remote hit
rate, bytes exchanged per machine per epoch (sent plus received), the
trainer's wait and the eviction rounds, as means over the epochs after the
first; a table per machine count with ratios against ``none`` measured in the
same run. ``--out DIR`` gets ``distributed.json`` and, with ``--plot``, two
PNGs: the hit rate per epoch per policy, and bytes exchanged per policy.

Links (``--links``): ``loopback`` runs the exchange and the gradients as
they are, over this host's loopback, where moving a row costs next to
nothing. A number ``M`` models a network link of ``M`` Mbit/s each way per
machine (full duplex), with a time per message of ``--link-latency-ms``;
by default that is derived from the rate: ``0.05 ms x 10,000 / M``, the
per-message cost of a 10 Gbit/s network slowed down as much as the rate
is (25 ms at 20 Mbit/s), so that the link is a uniformly slower network
rather than a slow wire with a datacentre's latency. Both kinds of traffic
of a machine go over it (:class:`ModelledLink`, one per machine):

* the row exchange: a round that moves rows lasts 3 messages (header,
  ids, rows), then the owners' serve time (the time the owner took to read
  the requested rows, measured on the owner and sent along with its rows:
  the slowest owner this machine asked rows of, or this machine itself
  when it served rows), then the transfer of the larger of the bytes the
  machine sent and received in it over the rate; an idle round (headers
  only) lasts one message. The serve time is added to the transfer, not
  overlapped with it (:class:`LinkExchange`, a bench-local subclass
  installed through ``PartitionedPasses.exchange_type``, waiting in
  ``RowExchange._moved``);
* the gradients: DDP's all-reduce of each gradient bucket, through a DDP
  communication hook (:meth:`ModelledLink.grad_hook`, registered on the
  strategy's ``DistributedDataParallel`` when the fit starts), is modelled
  as a ring all-reduce over ``n`` machines: ``2 (n - 1)`` messages, and
  ``2 (n - 1) / n`` x the bucket's bytes sent and as many received by each
  machine, over the rate.

A transfer starts once the link is free of the one before it (rows and
gradients queue on one link). Each collective's result is handed on when
both loopback brought it and the model says the link would have: the
process sleeps for whatever loopback left of the modelled time, so the
other machines' next collective waits for it, as on a real network. The
tables show the modelled seconds of the row rounds (``link s``) and of
the gradient all-reduces (``grad link s``) per machine per epoch. It is a
model, not a network: no TCP, no switch, no congestion between machines; the training
group's other collectives (set-up, the per-epoch agreements, a few bytes
each) stay on loopback.

Honest limits: every "machine" runs on this one host, so all of them share
its cores (2 on the reference machine). Epoch times are those of processes
contending for the same cores; over ``loopback`` a remote fetch costs no
round trip, and over a modelled link it costs what the model says; rows,
requests and bytes are exact and do not depend on the host.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from lightning_ooc.bench.system import (bench_workdir, code_version, machine_facts, parse_choices, save_plot,
                                        write_results)  # fmt: skip
from lightning_ooc.data.format import human_bytes
from lightning_ooc.data.synth import synthesize
from lightning_ooc.partitioned.exchange import RowExchange
from lightning_ooc.partitioned.partition import partition_dataset
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
import lightning_ooc
import torch
import torch.distributed as dist

POLICIES = ("none", "static", "scored")
ORDERS = ("drift", "shuffle")
LOOPBACK = "loopback"
COLORS = {"none": "C0", "static": "C1", "scored": "C2"}  # the plots' colour of each policy
#: the reference network a modelled link is a slowed-down copy of: 10 Gbit/s, 0.05 ms per message
REF_LINK_MBPS, REF_LATENCY_MS = 10_000.0, 0.05


# -- the modelled link ------------------------------------------------------------------------------------
def link_latency_s(mbps: float, latency_ms: float | None = None) -> float:
    """A modelled link's time per message, in seconds: ``latency_ms`` where given, else the reference network's
    (``REF_LATENCY_MS``) slowed down as much as the link's rate is (``x REF_LINK_MBPS / mbps``).

    >>> link_latency_s(10_000), link_latency_s(20), link_latency_s(20, latency_ms=1.0)
    (5e-05, 0.025, 0.001)
    """
    return (REF_LATENCY_MS * REF_LINK_MBPS / float(mbps) if latency_ms is None else float(latency_ms)) / 1e3


class ModelledLink:
    """One machine's link of ``mbps`` Mbit/s each way (full duplex), ``latency`` seconds per message
    (:func:`link_latency_s`), shared by the row exchange (:meth:`round`) and the gradient all-reduce
    (:meth:`allreduce`, through :meth:`grad_hook`): a transfer starts when the link is free of the one before it
    (:meth:`occupy`). Times are ``time.perf_counter`` values; :meth:`wait_until` sleeps until one.

    >>> link = ModelledLink(8, latency_ms=2.0)  # 1e6 bytes/s
    >>> link.round(100.0, sent=5000, received=3000, serve_s=0.5, busy=True)  # 3 messages, the serve, 5000 B
    (0.511, 100.511)
    >>> link.allreduce(100.2, nbytes=1000, world=2)  # 2 messages, then 1000 B once the rows' transfer is over
    (0.005, 100.512)
    """

    def __init__(self, mbps: float, latency_ms: float | None = None):
        self.mbps = float(mbps)
        self.rate = self.mbps * 1e6 / 8  # bytes per second
        self.latency = link_latency_s(self.mbps, latency_ms)
        self._lock = threading.Lock()
        self._free = 0.0  # when the transfer in progress ends
        self.rows_s = 0.0  # the modelled time of the row exchange's rounds, all together
        self.grads_s = 0.0  # the modelled time of the gradient all-reduces, all together
        self.grad_bytes = 0  # gradient bytes sent (as many received) under the ring all-reduce
        self.sleep: Callable[[float], None] = time.sleep

    def occupy(self, earliest: float, seconds: float) -> float:
        """Take the link for a transfer of ``seconds`` from ``earliest`` on, or once the one before it ended;
        when it ends."""
        with self._lock:
            self._free = max(earliest, self._free) + seconds
            return self._free

    def wait_until(self, t: float) -> None:
        left = t - time.perf_counter()
        if left > 0:
            self.sleep(left)

    def round(self, started: float, sent: int, received: int, serve_s: float, busy: bool) -> tuple[float, float]:
        """A row exchange round begun at ``started``: ``(its modelled seconds, when it ends)``. A round that
        moves rows (``busy``) is three messages (header, ids, rows), then the owners' serve time ``serve_s``, then
        the transfer of the larger direction, ``max(sent, received)``, over the rate; an idle one a message."""
        if not busy:
            self.rows_s += self.latency
            return self.latency, started + self.latency
        before = 3 * self.latency + serve_s
        transfer = max(sent, received) / self.rate
        self.rows_s += before + transfer
        return before + transfer, self.occupy(started + before, transfer)

    def allreduce(self, started: float, nbytes: int, world: int) -> tuple[float, float]:
        """A ring all-reduce of ``nbytes`` over ``world`` machines begun at ``started``: ``(its modelled seconds,
        when it ends)``: ``2 (world - 1)`` messages, and ``2 (world - 1) / world x nbytes`` sent and as many
        received by each machine (full duplex: their time once) over the rate."""
        if world <= 1:
            return 0.0, started
        before = 2 * (world - 1) * self.latency
        wire = 2 * (world - 1) / world * nbytes
        transfer = wire / self.rate
        with self._lock:
            self.grads_s += before + transfer
            self.grad_bytes += int(round(wire))
        return before + transfer, self.occupy(started + before, transfer)

    def grad_hook(self, world: int) -> Callable[[Any, Any], torch.futures.Future]:
        """A DDP communication hook (``DistributedDataParallel.register_comm_hook(None, hook)``): each gradient
        bucket is all-reduced as DDP does by default (``allreduce_hook``: the mean over the group), and its future
        completes once loopback brought it and the modelled all-reduce (:meth:`allreduce` over ``world``
        machines) would have."""

        def hook(process_group, bucket):  # no annotations: DDP accepts only its own types there, unstringified
            started = time.perf_counter()
            buf = bucket.buffer()
            _, done = self.allreduce(started, buf.numel() * buf.element_size(), world)

            def arrived(fut: torch.futures.Future) -> torch.Tensor:
                self.wait_until(done)
                return fut.value()

            return allreduce_hook(process_group, bucket).then(arrived)

        return hook


# -- the drifting seed order and the modelled link (bench-local subclasses; the library is unchanged) ------
def _subclasses():
    """The subclasses, made on first use (importing torch and Lightning only where a machine runs):
    ``(DriftSeedBatches, BenchPasses, BenchNodeData, LinkExchange)``."""
    global DriftSeedBatches, BenchPasses, BenchNodeData, LinkExchange
    if "BenchNodeData" in globals():
        return DriftSeedBatches, BenchPasses, BenchNodeData, LinkExchange

    from lightning_ooc import OutOfCoreNodeData  # lazy: it imports Lightning
    # lazy: it imports PyG and Triton
    from lightning_ooc.loader.partitioned import PartitionedPasses, PartitionSeedBatches, cut, local_share

    class _DriftSeedBatches(PartitionSeedBatches):
        """Training seeds swept in locality order from a start that moves every epoch (see the module docstring)."""

        key: np.ndarray
        step: float

        @classmethod
        def of(cls, base: PartitionSeedBatches, key: np.ndarray, step: float) -> "_DriftSeedBatches":
            obj = cls.__new__(cls)
            obj.__dict__.update(base.__dict__)
            obj.key, obj.step = key, float(step)
            return obj

        def order(self, epoch: int) -> torch.Tensor:
            seeds = self._seeds("train")
            s = seeds.numpy()
            ordered = seeds[torch.from_numpy(np.lexsort((s, self.key[s])))]
            n = ordered.numel()
            start = int(round(epoch * self.step * n)) % max(n, 1)
            return torch.cat([ordered[start:], ordered[:start]])

        def epoch(self, split: str, epoch: int):
            if split != "train":
                return super().epoch(split, epoch)
            share = local_share(self.order(epoch), self.local_rank, self.local_world)
            return cut(share, self._counts["train"], self.batch_size, self.drop_last)

    class _LinkExchange(RowExchange):
        """The row exchange over a :class:`ModelledLink` (``link``; see the module docstring). Each owner sends its
        serve time of the round along with the rows it sends (8 bytes after each peer's rows, not counted as
        traffic: they stand for the time that passes on a real network, not for data it carries)."""

        link: ModelledLink
        link_s = 0.0  # what the modelled link took, every round together
        _serve_s = 0.0  # the round's serve time: the slowest owner this process asked rows of, or itself

        def _send_rows(self, rows: torch.Tensor, in_splits: list[int], out_splits: list[int],
                       served: float) -> torch.Tensor:  # fmt: skip
            rb = self.row_bytes
            stamp = torch.tensor([served], dtype=torch.float64).view(torch.uint8)
            parts = torch.split(rows.reshape(-1), [n * rb for n in out_splits])
            send = torch.cat([x for part in parts for x in (part, stamp)])
            sizes = [n * rb + 8 for n in in_splits]
            got = torch.empty(sum(sizes), dtype=torch.uint8)
            dist.all_to_all_single(got, send, sizes, [n * rb + 8 for n in out_splits], group=self.group)
            chunks = torch.split(got, sizes)
            owners = [float(c[-8:].clone().view(torch.float64)) for c, n in zip(chunks, in_splits) if n]
            # its own rows leave this process once it served them; the rows it asked for, once their owner did
            self._serve_s = max(owners + ([served] if sum(out_splits) else []), default=0.0)
            return torch.cat([c[:-8] for c in chunks]).view(-1, rb)

        def _moved(self, started: float, sent: int, received: int, busy: bool) -> None:
            # before the round's rows are handed out: they arrive when the link would have brought them
            cost, done = self.link.round(started, sent, received, self._serve_s if busy else 0.0, busy)
            self.link_s += cost
            self.link.wait_until(done)

    class _BenchPasses(PartitionedPasses):
        drift, locality, step = False, "label", 0.25

        def _seed_batches(self, ds: Any):
            base = super()._seed_batches(ds)
            if not self.drift:
                return base
            labels = getattr(ds, "labels", None)
            if self.locality == "label" and labels is not None:
                key = np.asarray(labels).astype(np.int64)
            else:
                key = np.arange(ds.num_nodes, dtype=np.int64)
            return _DriftSeedBatches.of(base, key, self.step)

    class _BenchNodeData(OutOfCoreNodeData):
        """``OutOfCoreNodeData`` with the drift order (``drift``) and a modelled link (``link_mbps``)."""

        def __init__(self, *a: Any, drift: bool = False, locality: str = "label", drift_step: float = 0.25,
                     link_mbps: float | None = None, link_latency_ms: float | None = None, **kw: Any):  # fmt: skip
            super().__init__(*a, **kw)
            self.bench = {"drift": drift, "locality": locality, "step": drift_step}
            self.modelled_link = ModelledLink(link_mbps, link_latency_ms) if link_mbps else None
            if self.modelled_link is not None:
                self.bench["exchange_type"] = type("Link", (_LinkExchange,), {"link": self.modelled_link})

        def _local_source(self, ctx):
            return type("BenchPassesFor", (_BenchPasses,), dict(self.bench))(self.config, ctx)

    DriftSeedBatches, BenchPasses, BenchNodeData, LinkExchange = (_DriftSeedBatches, _BenchPasses, _BenchNodeData,
                                                                  _LinkExchange)  # fmt: skip
    return DriftSeedBatches, BenchPasses, BenchNodeData, LinkExchange


# -- one machine (run by torchrun) ----------------------------------------------------------------------
def machine(spec: dict[str, Any]) -> int:
    """Train one configuration on this machine; write ``rank<R>.json`` with the per-epoch figures."""
    import lightning as L  # lazy: Lightning takes seconds to import

    from lightning_ooc import OutOfCoreNodeData, Partitioned  # lazy: it imports Lightning
    from lightning_ooc.models import GraphSAGE  # lazy: it imports Lightning and PyG

    torch.set_num_threads(1)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    machines = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    node = int(os.environ.get("GROUP_RANK", "0"))
    L.seed_everything(spec["seed"], workers=False)
    features = Partitioned(host_cache=spec["host_cache"], gpu_cache="2MiB", staging="4MiB",
                           remote_cache=str(spec["remote_cache"][node]), remote_cache_policy=spec["policy"],
                           cache_decay=spec["gamma"], cache_interval=spec["interval"],
                           exchange_timeout=spec["timeout"])  # fmt: skip
    kw = dict(batch_size=spec["batch_size"], num_neighbors=spec["fanout"], features=features,
              pipeline={"num_samplers": 1, "num_extractors": 1}, progress=False, seed=spec["seed"])  # fmt: skip
    link = spec.get("link", LOOPBACK)
    if spec["order"] == "drift" or link != LOOPBACK:
        dm = _subclasses()[2](spec["root"], drift=spec["order"] == "drift", locality=spec["locality"],
                              drift_step=spec["drift_step"], link_mbps=None if link == LOOPBACK else float(link),
                              link_latency_ms=spec.get("link_latency_ms"), **kw)  # fmt: skip
    else:
        dm = OutOfCoreNodeData(spec["root"], **kw)
    model = GraphSAGE(dm.num_features, dm.num_classes, hidden_channels=spec["hidden"], num_layers=len(spec["fanout"]),
                      lr=0.01)  # fmt: skip
    epochs: list[dict[str, Any]] = []
    link = getattr(dm, "modelled_link", None)

    class Record(L.Callback):
        link: dict[str, float] = {}

        def on_fit_start(self, trainer, pl_module):
            if link is None:
                return
            # the gradients over the modelled link too: DDP's all-reduce of each bucket, delayed by the model
            ddp = trainer.strategy.model
            if not isinstance(ddp, DistributedDataParallel):
                raise RuntimeError(f"a modelled link needs the DDP strategy's model, found {type(ddp).__name__}")
            ddp.register_comm_hook(None, link.grad_hook(trainer.world_size))

        def on_train_epoch_start(self, trainer, pl_module):
            self.t0 = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module):
            wall = time.perf_counter() - self.t0
            st = dm.last_stats.get("train")
            rec = {"epoch": trainer.current_epoch, "wall_s": wall}
            if st is not None:
                rec.update(st.as_metrics(getattr(dm.dataset, "row_bytes", 0)))
                rec["seconds"] = st.seconds
                rec["batches"] = st.batches
            # the modelled link's clocks are cumulative: this epoch's share
            now = {"link_s": link.rows_s, "grad_link_s": link.grads_s, "grad_bytes": link.grad_bytes} if link else {}
            for k, v in now.items():
                rec[k] = v - self.link.get(k, 0)
            self.link = now
            epochs.append(rec)
            remote = getattr(dm.source, "remote", None)
            buf = getattr(remote, "buffer", None)
            self.buffer_rows = int(buf.capacity) if buf is not None else 0
            self.warm = (int(getattr(dm.source, "remote_warm_rows", 0)),
                         float(getattr(dm.source, "remote_warm_seconds", 0.0)))

    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=machines, strategy="ddp", max_epochs=spec["epochs"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[record := Record()])  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    total = time.perf_counter() - t0
    warm = getattr(record, "warm", (0, 0.0))
    doc = {"rank": trainer.global_rank, "machine": node, "machines": machines, "epochs": epochs, "fit_s": total,
           "buffer_rows": getattr(record, "buffer_rows", 0), "warm_rows": warm[0], "warm_s": warm[1]}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(doc))
    return 0


# -- the parent ------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", nargs="?", type=Path, help="an (unpartitioned) dataset; default: a synthetic graph")
    g = p.add_argument_group("synthetic graph (without ROOT)")
    g.add_argument("--nodes", type=int, default=200_000)
    g.add_argument("--features", type=int, default=64, help="float32 features per node")
    g.add_argument("--communities", type=int, default=16, help="planted communities (the graph's classes)")
    g.add_argument("--avg-degree", type=float, default=10.0)
    g.add_argument("--homophily", type=float, default=0.9, help="share of edges inside a community")
    g.add_argument("--train-frac", type=float, default=0.1)
    p.add_argument("--machines", default="2,4", help="simulated machine counts (comma-separated)")
    p.add_argument("--policies", default=",".join(POLICIES), help="remote_cache_policy values: none,static,scored")
    p.add_argument("--orders", default="drift,shuffle", help="seed orders: drift (locality sweep) and/or shuffle")
    p.add_argument("--locality", choices=("label", "id"), default="label",
                   help="drift order key: the planted community (label) or the node id")
    p.add_argument("--drift-step", type=float, default=0.25, help="share of the seeds the drift start moves per epoch")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--fanout", default="10,5")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--remote-fraction", type=float, default=0.2,
                   help="buffer size as a share of the nodes a machine does not own (the paper's f_p^h)")
    p.add_argument("--gamma", type=float, default=0.995, help="score decay per minibatch (the paper: 0.995)")
    p.add_argument("--interval", type=int, default=8,
                   help="minibatches between eviction rounds (the paper: 32; 8 here because an epoch of these short "
                        "runs has 40-80 minibatches per machine, and a community of the drift order about 5-10)")
    p.add_argument("--links", default=LOOPBACK,
                   help="row exchange links (comma-separated): loopback (as it is), or a modelled link of that many "
                        "Mbit/s per machine (e.g. loopback,200,50,20)")
    p.add_argument("--link-latency-ms", type=float,
                   help="a modelled link's time per message (milliseconds; default: derived from its rate, "
                        f"{REF_LATENCY_MS:g} ms x {REF_LINK_MBPS:,.0f} / M for M Mbit/s: the per-message cost of a "
                        f"{REF_LINK_MBPS / 1000:g} Gbit/s network slowed down as much as the rate, e.g. 25 ms at 20)")
    p.add_argument("--host-cache", default="8MiB", help="each machine's host cache for its own rows")
    p.add_argument("--method", default="auto", help="partition method (auto: metis if installed, else fennel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds one configuration may run")
    p.add_argument("--workdir", type=Path, help="where graph and partitions go (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=Path("bench-results/distributed"),
                   help="directory for distributed.json and the plots")
    p.add_argument("--json", type=Path, help="write the JSON here instead of OUT/distributed.json")
    p.add_argument("--plot", action="store_true", help="also write PNGs (needs matplotlib)")
    p.add_argument("--machine", help=argparse.SUPPRESS)  # internal: one machine's spec (JSON)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine_roots(parts_out: Path, base: Path, parts: int) -> list[Path]:
    """One directory per machine holding its own part only (hard links)."""
    roots = []
    for k in range(parts):
        root = base / f"machine{k}" / "parts"
        shutil.rmtree(root, ignore_errors=True)  # a partition made afresh: never links to an older one
        try:
            shutil.copytree(parts_out / f"part-{k:05d}", root / f"part-{k:05d}", copy_function=os.link)
        except OSError:
            shutil.copytree(parts_out / f"part-{k:05d}", root / f"part-{k:05d}")
        roots.append(root)
    return roots


def launch(roots: list[Path], spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one configuration: one torchrun per machine; the ranks' JSONs, or an error."""
    out = Path(spec["out"])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    t0 = time.perf_counter()
    for k, root in enumerate(roots):
        s = {**spec, "root": str(root)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(roots)), "--node-rank", str(k),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "lightning_ooc.bench.distributed", "--machine", json.dumps(s)]  # fmt: skip
        log = open(out / f"machine{k}.log", "w")
        logs.append(log)
        # a session of its own: a timeout kills the launcher and its worker together
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    deadline = time.monotonic() + timeout
    failed = None
    try:
        for k, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"timed out after {timeout:.0f} s"
                break
            if rc != 0 and failed is None:
                failed = f"machine {k} exited {rc}"
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker too, should the launcher have left it behind
            except ProcessLookupError:
                pass
            p.wait()
        for log in logs:
            log.close()
    wall = time.perf_counter() - t0
    if failed:
        tail = (out / "machine0.log").read_text()[-3000:] if (out / "machine0.log").exists() else ""
        return {"error": failed, "log_tail": tail, "wall_s": wall}
    ranks = [json.loads((out / f"rank{k}.json").read_text()) for k in range(len(roots))]
    return {"ranks": ranks, "wall_s": wall}


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-epoch figures over machines (times: the slowest; counts: the mean per machine) and their summary."""
    n = min(len(r["epochs"]) for r in ranks)
    mean_keys = ("remote_rows", "remote_fetched_rows", "remote_replaced_rows", "exchange_bytes", "exchange_rounds",
                 "eviction_rounds", "trainer_wait_s", "remote_wait_s", "link_s", "grad_link_s",
                 "grad_bytes")  # fmt: skip
    per_epoch = []
    for e in range(n):
        rows = [r["epochs"][e] for r in ranks]
        d = {"epoch": e, "seconds": max(x["wall_s"] for x in rows)}
        for k in mean_keys:
            d[k] = float(np.mean([x.get(k, 0.0) for x in rows]))
        asked = sum(x.get("remote_rows", 0.0) for x in rows)
        hits = sum(x.get("remote_rows", 0.0) * x.get("remote_hit_rate", 0.0) for x in rows)
        d["remote_hit_rate"] = hits / asked if asked else 0.0
        per_epoch.append(d)
    later = per_epoch[1:] or per_epoch

    def mean(k: str) -> float:
        return float(np.mean([d[k] for d in later]))

    summary = {k: mean(k) for k in ("seconds", *mean_keys, "remote_hit_rate")}
    summary["first_epoch_seconds"] = per_epoch[0]["seconds"] if per_epoch else None
    summary["buffer_rows"] = float(np.mean([r["buffer_rows"] for r in ranks]))
    summary["warm_rows"] = float(np.mean([r["warm_rows"] for r in ranks]))
    return {"per_epoch": per_epoch, "summary": summary}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _link_name(link: str, latency_ms: float | None = None) -> str:
    if link == LOOPBACK:
        return "loopback"
    return f"a modelled {link} Mbit/s link ({link_latency_s(float(link), latency_ms) * 1e3:g} ms per message)"


def format_table(machines: int, order: str, results: dict[str, dict[str, Any]], link: str = LOOPBACK,
                 latency_ms: float | None = None) -> str:  # fmt: skip
    base = results.get("none", {}).get("summary")
    head = ("| policy | buffer rows | s/epoch (later) | first epoch s | remote rows | fetched rows | hit rate | "
            "MB exchanged | trainer wait s | link s | grad link s | eviction rounds |")  # fmt: skip
    lines = [f"{machines} machines, order {order}, rows and gradients over {_link_name(link, latency_ms)} (per "
             "machine per epoch; ratios against none; link s: the modelled time of the row exchange's rounds, grad "
             "link s: of the gradient all-reduces)", "", head, "|" + "---|" * 12]  # fmt: skip
    for pol, res in results.items():
        if "error" in res:
            lines.append(f"| {pol} | failed: {res['error']} |" + " |" * 10)
            continue
        s = res["summary"]

        def cell(k: str, fmt: str, scale: float = 1.0) -> str:
            v = s[k] * scale
            txt = format(v, fmt)
            if base is not None and pol != "none" and k in ("seconds", "first_epoch_seconds", "remote_fetched_rows",
                                                           "exchange_bytes", "trainer_wait_s"):  # fmt: skip
                txt += f" ({_ratio(s[k], base[k])})"
            return txt

        lines.append(f"| {pol} | {s['buffer_rows']:,.0f} | {cell('seconds', '.2f')} | "
                     f"{cell('first_epoch_seconds', '.2f')} | {s['remote_rows']:,.0f} | "
                     f"{cell('remote_fetched_rows', ',.0f')} | {s['remote_hit_rate']:.3f} | "
                     f"{cell('exchange_bytes', ',.1f', 1e-6)} | {cell('trainer_wait_s', '.2f')} | "
                     f"{s.get('link_s', 0.0):.2f} | {s.get('grad_link_s', 0.0):.2f} | "
                     f"{s['eviction_rounds']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def _plot(doc: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib  # lazy: matplotlib only for the plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot
    except ImportError:
        return ["no plot: matplotlib is not installed (pip install matplotlib)"]
    runs = [r for r in doc["runs"] if "error" not in r]
    if not runs:
        return ["no plot: no configuration ran"]
    def link(r: dict[str, Any]) -> str:
        return str(r.get("link", LOOPBACK))

    groups = sorted({(r["machines"], r["order"], link(r)) for r in runs})
    done = []
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 2.8), squeeze=False, sharey=True)
    for ax, (m, o, ln) in zip(axes[0], groups):
        for r in runs:
            if (r["machines"], r["order"], link(r)) == (m, o, ln):
                ep = r["per_epoch"]
                ax.plot([d["epoch"] for d in ep], [d["remote_hit_rate"] for d in ep], marker="o", label=r["policy"])
        ax.set_title(f"{m} machines, {o}" + ("" if ln == LOOPBACK else f", {ln} Mbit/s"), fontsize=9)
        ax.set_xlabel("epoch")
    axes[0][0].set_ylabel("remote hit rate")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    p = out / "distributed-hit-rate.png"
    save_plot(fig, p, dpi=80)
    plt.close(fig)
    done.append(f"plot: {p}")
    fig, ax = plt.subplots(figsize=(6, 2.8))
    labels, values = [], []
    for r in runs:
        labels.append(f"{r['machines']}m {r['order'][:5]}" + ("" if link(r) == LOOPBACK else f" {link(r)}M")
                      + f"\n{r['policy']}")
        values.append(r["summary"]["exchange_bytes"] / 1e6)
    ax.bar(range(len(values)), values, color=[COLORS.get(r["policy"], "C3") for r in runs])
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    ax.set_ylabel("MB exchanged / machine / epoch")
    fig.tight_layout()
    p = out / "distributed-bytes.png"
    save_plot(fig, p, dpi=80)
    plt.close(fig)
    done.append(f"plot: {p}")
    modelled = [r for r in runs if link(r) != LOOPBACK]
    if modelled:  # seconds per epoch against the modelled link's rate, one line per policy and setting
        fig, ax = plt.subplots(figsize=(4.5, 3))
        keys = sorted({(r["machines"], r["order"], r["policy"]) for r in modelled})
        for key in keys:
            pts = sorted((float(link(r)), r["summary"]["seconds"]) for r in modelled
                         if (r["machines"], r["order"], r["policy"]) == key)  # fmt: skip
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{key[0]}m {key[1]} {key[2]}",
                    color=COLORS.get(key[2], "C3"), linestyle="-" if key[0] == min(k[0] for k in keys) else "--")
        ax.set_xscale("log")
        ax.set_xlabel("modelled link, Mbit/s")
        ax.set_ylabel("s / epoch")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / "distributed-link.png"
        save_plot(fig, p, dpi=80)
        plt.close(fig)
        done.append(f"plot: {p}")
    return done


def run(args: argparse.Namespace) -> int:
    if getattr(args, "machine", None):
        return machine(json.loads(args.machine))

    policies = parse_choices(args.policies, POLICIES, "policy")
    orders = parse_choices(args.orders, ORDERS, "order")
    counts = [int(x) for x in str(args.machines).split(",") if x.strip()]
    links = [x.strip() for x in str(args.links).split(",") if x.strip()]
    for x in links:
        if x != LOOPBACK and not (x.replace(".", "", 1).isdigit() and float(x) > 0):
            raise SystemExit(f"unknown link {x!r}; use {LOOPBACK} or a rate in Mbit/s (e.g. 100)")
    fanout = [int(x) for x in str(args.fanout).split(",")]
    t_start = time.perf_counter()
    tmp = None
    work = args.workdir
    if work is None:
        tmp = tempfile.mkdtemp(prefix="ooc-bench-dist-")
        work = Path(tmp)
    work = bench_workdir(work)
    made = None
    try:
        if args.root is None:
            t0 = time.perf_counter()
            root = synthesize(work / "graph", num_nodes=args.nodes, avg_degree=args.avg_degree,
                              num_features=args.features, num_classes=args.communities, homophily=args.homophily,
                              train_frac=args.train_frac, val_frac=0.005, test_frac=0.005, seed=args.seed,
                              overwrite=True, progress=False)  # fmt: skip
            made = {"nodes": args.nodes, "features": args.features, "communities": args.communities,
                    "avg_degree": args.avg_degree, "homophily": args.homophily, "train_frac": args.train_frac,
                    "seconds": time.perf_counter() - t0}  # fmt: skip
        else:
            root = args.root
        ds = lightning_ooc.open_dataset(root)
        facts = {"root": str(root), "nodes": ds.num_nodes, "edges": ds.num_edges, "features": ds.num_features,
                 "row_bytes": ds.row_bytes, "train_seeds": len(ds.split("train"))}  # fmt: skip
        print(f"graph {root}: {facts['nodes']:,} nodes, {facts['edges']:,} edges, dim {facts['features']} "
              f"({facts['row_bytes']} B/row), {facts['train_seeds']:,} training seeds"
              + (f" (synthetic, {args.communities} communities, homophily {args.homophily}; made in "
                 f"{made['seconds']:.1f} s)" if made else ""), flush=True)  # fmt: skip
        runs, tables, partitions = [], [], []
        for m in counts:
            t0 = time.perf_counter()
            parts_out = partition_dataset(root, m, work / f"parts{m}", method=args.method, seed=args.seed,
                                          overwrite=True, progress=False)  # fmt: skip
            owner = np.load(parts_out / "owner.npy")
            pmeta = json.loads((parts_out / "part-00000" / "meta.json").read_text()).get("partition", {})
            remote_nodes = [int((owner != k).sum()) for k in range(m)]
            buf_rows = [int(args.remote_fraction * r) for r in remote_nodes]
            cache = [max(1, b) * facts["row_bytes"] for b in buf_rows]
            partitions.append({"machines": m, "seconds": time.perf_counter() - t0, "remote_nodes": remote_nodes,
                               "buffer_rows": buf_rows, "buffer_bytes": cache,
                               "method": pmeta.get("method"), "edge_cut": pmeta.get("edge_cut")})  # fmt: skip
            print(f"{m} machines: partitioned ({pmeta.get('method', '?')}) in {time.perf_counter() - t0:.1f} s; "
                  f"buffer {args.remote_fraction:g} of {np.mean(remote_nodes):,.0f} remote nodes = "
                  f"{np.mean(buf_rows):,.0f} rows ({human_bytes(np.mean(cache))}) per machine", flush=True)  # fmt: skip
            roots = _machine_roots(parts_out, work / f"m{m}", m)
            for order, ln in [(o, x) for x in links for o in orders]:
                results: dict[str, dict[str, Any]] = {}
                for pol in policies:
                    spec = {"out": str(work / f"run-{m}-{order}-{ln}-{pol}"), "policy": pol, "order": order,
                            "link": ln, "link_latency_ms": args.link_latency_ms,
                            "epochs": args.epochs, "batch_size": args.batch_size, "fanout": fanout,
                            "hidden": args.hidden, "remote_cache": cache, "gamma": args.gamma,
                            "interval": args.interval, "host_cache": args.host_cache, "seed": args.seed,
                            "locality": args.locality, "drift_step": args.drift_step,
                            "timeout": min(120.0, args.timeout)}  # fmt: skip
                    print(f"  {m} machines, {order}, {_link_name(ln, args.link_latency_ms)}, {pol}: running...",
                          end="", flush=True)  # fmt: skip
                    res = launch(roots, spec, args.timeout)
                    rec = {"machines": m, "order": order, "link": ln, "policy": pol, "wall_s": res["wall_s"]}
                    if "error" in res:
                        rec.update(error=res["error"], log_tail=res["log_tail"])
                        print(f" failed ({res['error']})\n{res['log_tail']}", flush=True)
                    else:
                        rec.update(summarize(res["ranks"]))
                        rec["ranks"] = res["ranks"]
                        print(f" {res['wall_s']:.0f} s", flush=True)
                    results[pol] = rec
                    runs.append(rec)
                table = format_table(m, order, results, ln, args.link_latency_ms)
                tables.append(table)
                print("\n" + table + "\n", flush=True)
        took = time.perf_counter() - t_start
        doc = {"kind": "distributed", **code_version(), "machine": machine_facts(), "graph": facts, "synthetic": made,
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                            if k not in ("func", "machine")},
               "partitions": partitions, "runs": runs, "tables": tables, "seconds": took,
               "note": "all machines share this host's cores and loopback: times are of contending processes, "
                       "not of a network; rows, requests and bytes are exact"}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        path = write_results(doc, args.json or args.out / "distributed.json", "distributed")
        print(f"json: {path}")
        if args.plot:
            for line in _plot(doc, args.out):
                print(line)
        print(f"bench took {took:.0f} s")
        return 0 if not any("error" in r for r in runs) else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lightning-ooc bench distributed", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
