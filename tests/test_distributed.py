"""Data-parallel training on packed batches (examples/ddp_train.py), in two spawned gloo processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from padless.distributed import global_count, global_mean
from padless.loaders import BudgetBatchSampler, TokenBudget
from padless.loaders.synthetic import write_shards
from padless.testing.ddp import check_rank

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ddp")
    shard_dir = tmp / "shards"
    shard_dir.mkdir()
    write_shards(str(shard_dir), num_shards=2, per_shard=3, low=8, high=16)  # fewer samples than 10 per rank
    torch.multiprocessing.spawn(
        check_rank, args=(2, f"file://{tmp}/store", str(tmp), EXAMPLE, str(shard_dir)), nprocs=2
    )
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_gradients_equal_single_process_on_the_union(ranks, kind):
    if kind not in ranks[0]["grads"]:
        pytest.skip(f"FSDP2 did not run here: {ranks[0].get('fsdp_error')}")
    # the ranks held different numbers of tokens, so a per-rank mean would weigh them wrongly
    assert ranks[0]["grads"][kind]["local_tokens"] != ranks[1]["grads"][kind]["local_tokens"]
    for r in ranks:
        got, want = r["grads"][kind]["got"], r["grads"][kind]["want"]
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_every_rank_runs_the_same_number_of_steps(ranks):
    assert ranks[0]["full"]["epoch_steps"] == ranks[1]["full"]["epoch_steps"] > 1
    # the stream has 6 samples over 2 ranks, each asked for 10: passes repeat, same count
    assert ranks[0]["stream_steps"] == ranks[1]["stream_steps"] == 3


def test_ranks_take_disjoint_batches(ranks):
    a = {i for b in ranks[0]["full"]["batches"] for i in b}
    b = {i for b in ranks[1]["full"]["batches"] for i in b}
    assert a and b and not a & b


def test_resumed_run_continues_with_the_same_batches_and_weights(ranks):
    for r in ranks:
        assert r["resumed"]["batches"] == r["full"]["batches"][2:]
        for name, p in r["full"]["params"].items():
            torch.testing.assert_close(r["resumed"]["params"][name], p, msg=name)


def test_global_tokens_is_known_locally_on_every_rank():
    lengths = [5, 30, 8, 12, 3, 40, 22, 9]
    samplers = [BudgetBatchSampler(lengths, TokenBudget(48), rank=r, world_size=2) for r in range(2)]
    for step in range(len(samplers[0])):
        mine = [sum(lengths[i] for i in s.batches()[step]) for s in samplers]
        assert samplers[0].global_tokens(step) == samplers[1].global_tokens(step) == sum(mine)
    assert samplers[0].global_tokens(range(2)) == samplers[0].global_tokens(0) + samplers[0].global_tokens(1)
    with pytest.raises(ValueError, match=r"step_batches: step must be an int in \[0, "):
        samplers[0].step_batches(len(samplers[0]))


def test_global_mean_without_a_process_group():
    assert global_mean(torch.tensor(6.0), 3).item() == 2.0
    assert global_count(5) == 5
    with pytest.raises(ValueError, match="global_tokens is 0"):
        global_mean(torch.tensor(1.0), 0)
    with pytest.raises(TypeError, match="python int"):
        global_mean(torch.tensor(1.0), torch.tensor(3))
