"""The embedding datamodule's settings: the buffer and negatives groups (each checks its own fields, naming them as
they are written), memory_limit, plain hyperparameters through a checkpoint, nested settings from the command line."""
from __future__ import annotations

import dataclasses
import inspect

import lightning as L
import numpy as np
import pytest
import torch
import yaml

from lightning_ooc.embed import ChunkNegatives, OutOfCoreEmbeddingData, PartitionBuffering, init_embeddings
from lightning_ooc.errors import InputError

from jobs import REPO


@pytest.fixture()
def table(tmp_path):
    rng = np.random.default_rng(0)
    edges = {"train": (rng.integers(0, 60, 400), rng.integers(0, 60, 400)),
             "val": (rng.integers(0, 60, 40), rng.integers(0, 60, 40))}  # fmt: skip
    return init_embeddings(tmp_path / "e", num_nodes=60, dim=8, partitions=4, edges=edges, scale=0.1, progress=False)


def test_the_signature_has_the_groups_and_no_flat_names():
    params = list(inspect.signature(OutOfCoreEmbeddingData.__init__).parameters)
    assert params == ["self", "table", "batch_size", "buffer", "negatives", "memory_limit", "seed"]


def test_groups_hold_their_defaults_and_take_dicts(table):
    dm = OutOfCoreEmbeddingData(table)
    assert dm.config.buffer == PartitionBuffering(partitions=3, order="auto", in_memory=False, io_backend="auto")
    assert dm.config.negatives == ChunkNegatives(num=100, chunk_size=100, eval=1000, filtered=True)
    assert dm.config.negatives.eval_chunk == 100 and dm.config.memory_limit == "auto"
    dm = OutOfCoreEmbeddingData(table, buffer={"partitions": 2, "order": "greedy"}, negatives={"num": 8, "eval": "all"})
    assert dm.config.buffer == PartitionBuffering(partitions=2, order="greedy")
    assert dm.config.negatives.eval == "all" and dm.config.negatives.num == 8
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen: a change is a new group (dataclasses.replace)
        dm.config.buffer.partitions = 5


@pytest.mark.parametrize("kwargs, message", [
    (dict(buffer={"partitions": 0}), "buffer.partitions must be at least 1, got 0"),
    (dict(buffer=PartitionBuffering), "buffer must be a PartitionBuffering or a dict of its fields"),
    (dict(buffer={"order": "random"}), "buffer.order must be auto, legend, beta or greedy, got 'random'"),
    (dict(buffer={"io_backend": "aio"}), "buffer.io_backend must be one of auto, uring, pread, buffered, got 'aio'"),
    (dict(buffer={"partitions_in_buffer": 3}), "buffer: unknown setting(s) partitions_in_buffer; it takes partitions"),
    (dict(negatives={"num": 0}), "negatives.num must be at least 1, got 0"),
    (dict(negatives={"chunk_size": -1}), "negatives.chunk_size must be at least 1, got -1"),
    (dict(negatives={"eval": "some"}), "negatives.eval must be an integer of at least 1 or 'all', got 'some'"),
    (dict(negatives={"eval_chunk_size": 0}), "negatives.eval_chunk_size must be at least 1, got 0"),
    (dict(batch_size=0), "batch_size must be at least 1, got 0"),
    (dict(memory_limit="lots"), "memory_limit must be 'auto'"),
    (dict(memory_limit=True), "memory_limit must be 'auto'"),
])  # fmt: skip
def test_each_setting_is_checked_at_construction_by_its_name(table, kwargs, message):
    with pytest.raises(InputError) as err:
        OutOfCoreEmbeddingData(table, **kwargs)
    assert str(err.value).startswith(message), str(err.value)


def test_the_old_flat_keywords_are_gone(table):
    for old in ("partitions_in_buffer", "partition_order", "num_negatives", "chunk_size", "eval_negatives",
                "eval_chunk_size", "filtered", "in_memory", "io_backend", "memory_check"):  # fmt: skip
        with pytest.raises(TypeError):
            OutOfCoreEmbeddingData(table, **{old: 1})


def test_memory_limit_sets_the_buffer_check(table, monkeypatch):
    from lightning_ooc.store import limits

    # a size is this process's total: one below what it already holds refuses any buffer
    with pytest.raises(InputError, match=r"memory_limit=1MiB.*lower buffer.partitions.*--partitions"):
        OutOfCoreEmbeddingData(table, memory_limit="1MiB").setup("fit")
    monkeypatch.setattr(limits, "memory_limit", lambda *a, **k: limits.MemoryLimit(1000, "a test limit of 1 KB"))
    with pytest.raises(InputError, match="a test limit of 1 KB"):  # "auto": the cgroup's limit and MemAvailable
        OutOfCoreEmbeddingData(table).setup("fit")
    dm = OutOfCoreEmbeddingData(table, memory_limit=None)  # no check
    dm.setup("fit")
    dm.teardown("fit")


def test_all_eval_negatives_need_the_whole_table_resident(table):
    dm = OutOfCoreEmbeddingData(table, buffer={"partitions": 2}, negatives={"eval": "all"})
    dm.setup("fit")
    try:
        with pytest.raises(InputError, match=r"negatives.eval='all'.*set buffer.partitions to 4 or buffer.in_memory"):
            next(iter(dm.val_dataloader()))
    finally:
        dm.teardown("fit")


def test_hyperparameters_are_plain_and_rebuild_the_datamodule_through_a_checkpoint(table, tmp_path):
    """The groups are dicts in the hyperparameters (the table a string): a checkpoint loads them with
    ``weights_only``, and ``OutOfCoreEmbeddingData(**hparams)`` is the same datamodule."""
    from lightning_ooc.models import DistMult

    dm = OutOfCoreEmbeddingData(table, batch_size=50, buffer=PartitionBuffering(partitions=2, order="greedy"),
                                negatives={"num": 10, "chunk_size": 25, "eval": 20}, memory_limit="64GiB", seed=3)
    hp = dict(dm.hparams)
    assert hp == {"table": str(table), "batch_size": 50, "memory_limit": "64GiB", "seed": 3,
                  "buffer": {"partitions": 2, "order": "greedy", "in_memory": False, "io_backend": "auto"},
                  "negatives": {"num": 10, "chunk_size": 25, "eval": 20, "eval_chunk_size": None, "filtered": True}}
    assert OutOfCoreEmbeddingData(**hp).config == dm.config

    trainer = L.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(DistMult(dim=8), datamodule=dm)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["datamodule_hyper_parameters"]
    assert dict(saved) == hp
    assert OutOfCoreEmbeddingData(**saved).config == dm.config
    again = OutOfCoreEmbeddingData.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    assert again.config == dm.config and isinstance(again.config.buffer, PartitionBuffering)


def test_lightning_cli_sets_the_groups_fields_from_the_command_line(capsys):
    """``lightning-ooc fit --config configs/kge_demo.yaml`` with ``--data.negatives.num`` and
    ``--data.buffer.partitions``: the printed config has them, beside the config's other fields."""
    from lightning_ooc.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--print_config", "--config", str(REPO / "configs" / "kge_demo.yaml"),
              "--data.negatives.num", "5", "--data.buffer.partitions", "2"])  # fmt: skip
    assert stop.value.code in (0, None)
    data = yaml.safe_load(capsys.readouterr().out)["data"]
    assert data["class_path"] == "lightning_ooc.OutOfCoreEmbeddingData"
    args = data["init_args"]
    assert args["negatives"]["num"] == 5 and args["buffer"]["partitions"] == 2
    assert args["negatives"]["chunk_size"] == 100 and args["negatives"]["eval"] == 1000
    assert args["memory_limit"] == "auto"
    assert not {"partitions_in_buffer", "num_negatives", "eval_negatives", "memory_check"} & set(args)
    assert PartitionBuffering(**args["buffer"]).partitions == 2 and ChunkNegatives(**args["negatives"]).num == 5
