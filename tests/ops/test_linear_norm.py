"""Feature-wise layers through the reference harness."""

import pytest
import torch
import torch.nn.functional as F

from padless.testing import check_op, make_batch

TRAILING_STATIC = ["seq", "empty_sample", "one_sample", "all_equal", "pair", "rect", "three_ragged", "all_empty"]


@pytest.mark.parametrize("v", TRAILING_STATIC)
def test_linear_module(v):
    torch.manual_seed(0)
    nt, _ = make_batch(v)
    lin = torch.nn.Linear(nt.shape[-1], 5)
    check_op(lin, v)


@pytest.mark.parametrize("v", TRAILING_STATIC)
def test_layer_norm_module(v):
    nt, _ = make_batch(v)
    ln = torch.nn.LayerNorm(nt.shape[-1])
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    check_op(ln, v)


@pytest.mark.parametrize("v", ["seq", "pair"])
def test_mlp_block_bf16(v):
    torch.manual_seed(0)
    nt, _ = make_batch(v)
    c = nt.shape[-1]
    mlp = torch.nn.Sequential(torch.nn.LayerNorm(c), torch.nn.Linear(c, 8), torch.nn.GELU(), torch.nn.Linear(8, c)).to(torch.bfloat16)
    check_op(lambda x: x + mlp(x), v, dtype=torch.bfloat16)


def test_linear_weight_gradient_matches_per_sample_sum():
    torch.manual_seed(0)
    nt, dense = make_batch("pair")
    lin = torch.nn.Linear(2, 3)
    ref = torch.nn.Linear(2, 3)
    ref.load_state_dict(lin.state_dict())
    lin(nt).sum().backward()
    sum(ref(s).sum() for s in dense).backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_dropout_train_and_eval():
    nt, _ = make_batch("seq", high=3.0, low=1.0)
    assert F.dropout(nt, 0.5, training=False) is nt
    out = torch.nn.Dropout(0.5)(nt)
    kept = out.values() != 0
    torch.testing.assert_close(out.values()[kept], nt.values()[kept] * 2)
    assert 0 < int(kept.sum()) < nt.numel()


def test_feature_ops_refuse_ragged_last_dim():
    nt, _ = make_batch("channels_first")
    with pytest.raises(ValueError, match=r"linear\(\): sample dim 1 is ragged, but linear acts on the last 1 dim"):
        torch.nn.Linear(nt.shape[-1], 2)(nt)
    with pytest.raises(ValueError, match=r"layer_norm\(\): sample dim 1 is ragged"):
        F.layer_norm(nt, (nt.shape[-1],))
