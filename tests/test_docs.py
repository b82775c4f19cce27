"""The examples in docstrings run and give what they show."""
import doctest
import importlib

import pytest

MODULES = [
    "lightning_ooc",
    "lightning_ooc.data.format",
    "lightning_ooc.data.dataset",
    "lightning_ooc.data.commit",
    "lightning_ooc.data.writer",
    "lightning_ooc.data.synth",
    "lightning_ooc.data.prepare",
    "lightning_ooc.data.links",
    "lightning_ooc.data.hetero",
    "lightning_ooc.data.synth_hetero",
    "lightning_ooc.data.prepare_hetero",
    "lightning_ooc.testing",
    "lightning_ooc.io",
    "lightning_ooc.io.reader",
    "lightning_ooc.io.bulk",
    "lightning_ooc.io.stats",
    "lightning_ooc.store.buffer",
    "lightning_ooc.store.staging",
    "lightning_ooc.store.host_cache",
    "lightning_ooc.store.uva",
    "lightning_ooc.store.tiered",
    "lightning_ooc.store.tiers",
    "lightning_ooc.store.factory",
    "lightning_ooc.store.plan",
    "lightning_ooc.store.memory",
    "lightning_ooc.utils.cancel",
    "lightning_ooc.embed.batch",
    "lightning_ooc.embed.table",
    "lightning_ooc.embed.buckets",
    "lightning_ooc.embed.buffer",
    "lightning_ooc.embed.order",
    "lightning_ooc.embed.optim",
    "lightning_ooc.embed.datamodule",
    "lightning_ooc.embed.rows",
    "lightning_ooc.loader.learnable",
    "lightning_ooc.models.kge",
    "lightning_ooc.utils.logs",
    "lightning_ooc.loader.config",
    "lightning_ooc.loader.batches",
    "lightning_ooc.loader.context",
    "lightning_ooc.loader.source",
    "lightning_ooc.loader.links",
    "lightning_ooc.models",
    "lightning_ooc.models.node_classifier",
    "lightning_ooc.models.checks",
    "lightning_ooc.models.hetero",
    "lightning_ooc.datamodule",
    "lightning_ooc.callbacks",
    "lightning_ooc.strategy.ooc",
    "lightning_ooc.strategy.shared",
    "lightning_ooc.strategy.mps",
    "lightning_ooc.strategy.signals",
    "lightning_ooc.utils.trace",
    "lightning_ooc.dist.partition",
    "lightning_ooc.dist.policy",
    "lightning_ooc.loader.partitioned",
    "lightning_ooc.store.scored_cache",
    "lightning_ooc.cli",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0
