"""DDP trains every network family with deep supervision on and off, on 1 and 2 gloo ranks (torchrun's
environment, CPU): `train_fold` runs two steps, so a parameter the reducer waits for in vain (an unused
head with `find_unused_parameters=False`) fails the second step. The networks are the smallest their
plans allow (32³, 2 or 4 filters, one block per stage); one start of the ranks trains all ten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_helpers import spawn_ranks
from train_helpers import prepared_dataset, tiny_config

from brats_swap.distributed import DistContext
from brats_swap.train.loop import train_fold

NETWORKS = {
    "isensee2017": [],
    "nnunet": ["model.features=[2,4,8]"],
    "resenc_m": ["model.features=[2,4,8]"],
    "mednext_s": ["model.features=[2]", "model.blocks=[1,1,1,1,1,1,1,1,1]"],
    "segresnet": ["model.features=[2]"],
}
STEPS = ["train.steps_per_epoch=2", "train.max_epochs=1", "train.batch_size=1", "train.threads=1",
         "evaluate.hd95=false"]


def _train_every_network(ctx: DistContext, root: str, cache: str, runs: str) -> None:
    results = {}
    for name, overrides in NETWORKS.items():
        for deep_supervision in (True, False):
            key = f"{name}-ds{int(deep_supervision)}"
            config = tiny_config(Path(root), Path(cache), f"model.name={name}",
                                 f"model.deep_supervision={str(deep_supervision).lower()}", *overrides, *STEPS)
            result = train_fold(config, Path(runs) / key, 0, progress=False)
            results[key] = {"finished": result.finished, "losses": [row["train_loss"] for row in result.history]}
    (Path(runs) / f"rank{ctx.rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_dataset(tmp_path_factory)


@pytest.mark.parametrize("ranks", [1, 2])
def test_every_network_trains_under_ddp_with_deep_supervision_on_and_off(data, tmp_path, ranks):
    root, cache = data
    spawn_ranks(_train_every_network, ranks, str(root), str(cache), str(tmp_path))
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    expected = {f"{name}-ds{ds}" for name in NETWORKS for ds in (0, 1)}
    for result in results:
        assert result.keys() == expected
        for key, row in result.items():
            assert row["finished"] and len(row["losses"]) == 1, key
    assert all(result == results[0] for result in results)  # the losses are reduced over the ranks
