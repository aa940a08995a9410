"""``Field(pair_plans=recipe)``: a Collator's worker builds the bucket plans of a pair model
(padless.ops.pairs.recipe, padless.collation.pair_plans), so a step on a collated batch builds none
(counted as calls to the plan builders), with every sample equal to the model on that sample alone
and the results equal to a batch that built its own plans."""

from __future__ import annotations

import dataclasses
import functools
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import padless
from padless import Collator, Field
from padless.ops.common import content
from padless.ops.pairs import bucketed, recipe as rc
from padless.testing import assert_close_samples

NS = [3, 7, 1, 5, 4, 6]


class PairBiasAttention(nn.Module):
    """boltz's ``AttentionPairBias`` (v2) in substance: scores, a pair bias, a key mask, softmax, values."""

    def __init__(self, c_s: int = 8, c_z: int = 6, heads: int = 2, bias: bool = True) -> None:
        super().__init__()
        self.h, self.d, self.bias = heads, c_s // heads, bias
        self.proj_q, self.proj_k, self.proj_v, self.proj_g, self.proj_o = (nn.Linear(c_s, c_s) for _ in range(5))
        self.norm_z, self.proj_z = nn.LayerNorm(c_z), nn.Linear(c_z, heads, bias=False)

    def forward(self, s, z, mask):
        b = s.shape[0]
        q = self.proj_q(s).view(b, -1, self.h, self.d)
        k = self.proj_k(s).view(b, -1, self.h, self.d)
        v = self.proj_v(s).view(b, -1, self.h, self.d)
        attn = torch.einsum("bihd,bjhd->bhij", q, k) / self.d ** 0.5
        if self.bias:
            attn = attn + self.proj_z(self.norm_z(z)).permute(0, 3, 1, 2)
        attn = (attn + (1 - mask[:, None, None]) * -1e6).softmax(dim=-1)
        o = torch.einsum("bhij,bjhd->bihd", attn, v).reshape(b, -1, self.h * self.d)
        return self.proj_o(self.proj_g(s).sigmoid() * o)


def _samples(ns, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"s": torch.randn(n, 8, generator=g, dtype=torch.float64), "z": torch.randn(n, n, 6, generator=g, dtype=torch.float64),
             "mask": torch.ones(n, dtype=torch.float64)} for n in ns]


FIELDS = {"s": Field(ragged=0), "z": Field(ragged=(0, 1)), "mask": Field(ragged=0)}


def _model(bias=True):
    torch.manual_seed(0)
    return PairBiasAttention(bias=bias).double()


def _recipe(model):
    ex = Collator(FIELDS)(_samples([2, 6, 4], seed=9))
    return padless.pair_plan_recipe(model, ex.s, ex.z, ex.mask)


@pytest.fixture
def builds(monkeypatch):
    """Calls to the plan builders: bucket plans and their index maps."""
    calls: list[str] = []
    for mod, name in ((bucketed, "_build"), (bucketed, "padding_maps")):
        fn = getattr(mod, name)

        @functools.wraps(fn)
        def counted(*a, _fn=fn, _name=name, **k):
            calls.append(_name)
            return _fn(*a, **k)

        monkeypatch.setattr(mod, name, counted)
    return calls


def _step(model, b):
    s, z = b.s.detach().requires_grad_(), b.z.detach().requires_grad_()
    model.zero_grad()
    out = model(s, z, b.mask)
    g = torch.Generator().manual_seed(3)
    out.backward(padless.from_list([torch.randn(t.shape, generator=g, dtype=t.dtype) for t in out.unbind()]))
    return out, s.grad, z.grad, [p.grad.clone() for p in model.parameters()]


def test_recipe_records_the_attention_plans():
    recipe = _recipe(_model())
    assert [(s.ins, s.out) for s in recipe.steps] == [(("ihd", "jhd"), "hij"), (("hij", "jhd"), "ihd")]
    first, second = recipe.steps
    assert second.on == 0 and second.unread == 0 and second.operands[0].pending
    # the bias is read onto the scores in the buckets by rows (row maps, H times shorter than the
    # scores' element maps, which the step never builds)
    assert first.result_rows and not first.result_maps
    assert recipe.skipped == 0 and "2 plans" in repr(recipe)


@pytest.mark.parametrize("ns", [NS, [5], [2, 0, 4]], ids=["ragged", "one_sample", "empty_sample"])
def test_step_on_collated_batch_builds_no_plan(ns, builds):
    model = _model()
    collator = Collator({**FIELDS, "s": Field(ragged=0, pair_plans=_recipe(model))})
    content.clear()
    b = collator(_samples(ns))
    builds.clear()  # the collate call (a worker's share) builds them
    out, ds, dz, dparams = _step(model, b)
    assert builds == []
    # every sample equals the module on that sample alone: values, input and parameter gradients
    g = torch.Generator().manual_seed(3)
    refs, ref_ds, ref_dz = [], [], []
    model.zero_grad()
    for x in _samples(ns):
        s, z = x["s"][None].requires_grad_(), x["z"][None].requires_grad_()
        o = model(s, z, x["mask"][None])[0]
        o.backward(torch.randn(o.shape, generator=g, dtype=o.dtype))
        refs.append(o.detach()), ref_ds.append(s.grad[0]), ref_dz.append(z.grad[0])
    assert_close_samples(out, refs)
    assert_close_samples(ds, ref_ds, what="grad s")
    assert_close_samples(dz, ref_dz, what="grad z")
    for got, p in zip(dparams, model.parameters()):
        torch.testing.assert_close(got, p.grad)
    # the same samples from a batch that builds its own plans: the same plans, the same numbers
    content.clear()
    out2, ds2, dz2, dparams2 = _step(model, Collator(FIELDS)(_samples(ns)))
    assert builds.count("_build") == 2
    assert torch.equal(out.values(), out2.values()) and torch.equal(ds.values(), ds2.values())
    assert torch.equal(dz.values(), dz2.values()) and all(torch.equal(a, c) for a, c in zip(dparams, dparams2))


def test_main_process_builds_no_plan_with_workers(builds):
    """Batches from a DataLoader worker: the worker builds the plans, the main process none."""
    model = _model()
    collator = Collator({**FIELDS, "s": Field(ragged=0, pair_plans=_recipe(model))})
    content.clear()
    builds.clear()
    n = 0
    for b in DataLoader(_samples(NS + [2, 8], seed=4), batch_size=4, num_workers=1, collate_fn=collator):
        _step(model, b)
        n += 1
    assert n == 2 and builds == []


def test_pickled_batch_builds_no_plan(builds):
    model = _model()
    b = Collator({**FIELDS, "s": Field(ragged=0, pair_plans=_recipe(model))})(_samples(NS))
    data = pickle.dumps(b)
    content.clear()  # what the main process has on arrival: nothing but the batch
    builds.clear()
    out, *_ = _step(model, pickle.loads(data))
    assert builds == []
    content.clear()
    want, *_ = _step(model, Collator(FIELDS)(_samples(NS)))
    assert torch.equal(out.values(), want.values())


def test_result_maps_the_recipe_did_not_read_are_built_when_read(builds):
    """A recipe recorded without the score-sized bias carries no scores' maps; a model that reads
    the scores as rows (the bias) gets them built on first read, with the same numbers."""
    recipe = _recipe(_model(bias=False))
    assert not recipe.steps[0].result_maps
    model = _model()
    content.clear()
    b = Collator({**FIELDS, "s": Field(ragged=0, pair_plans=recipe)})(_samples(NS))
    builds.clear()
    out, ds, dz, _ = _step(model, b)
    assert builds.count("_build") == 1  # the scores' plan replayed for its maps, nothing else
    content.clear()
    want, ds2, dz2, _ = _step(model, Collator(FIELDS)(_samples(NS)))
    assert torch.equal(out.values(), want.values()) and torch.equal(dz.values(), dz2.values())


def test_plans_of_another_device_type_are_not_installed(builds):
    """Plans are priced for the device type they were recorded on: a recipe recorded for an
    accelerator leaves a CPU batch to build its own."""
    model = _model()
    recipe = _recipe(model)
    cuda = rc.PairPlanRecipe(tuple(dataclasses.replace(s, device_type="cuda") for s in recipe.steps))
    content.clear()
    b = Collator({**FIELDS, "s": Field(ragged=0, pair_plans=cuda)})(_samples(NS))
    builds.clear()
    out, *_ = _step(model, b)
    assert builds.count("_build") == 2
    content.clear()
    want, *_ = _step(model, Collator(FIELDS)(_samples(NS)))
    assert torch.equal(out.values(), want.values())


def test_plans_on_another_fields_lengths_are_skipped():
    """Cross attention from ``s`` (N_i) to ``t`` (M_i): the scores' rows are not the field's lengths."""
    model = _model(bias=False)

    def cross(s, t, mask):
        b = s.shape[0]
        q = model.proj_q(s).view(b, -1, 2, 4)
        k = model.proj_k(t).view(b, -1, 2, 4)
        return torch.einsum("bhij,bjhd->bihd", torch.einsum("bihd,bjhd->bhij", q, k).softmax(-1), k)

    g = torch.Generator().manual_seed(0)
    s = padless.from_list([torch.randn(n, 8, generator=g, dtype=torch.float64) for n in (2, 5, 3)])
    t = padless.from_list([torch.randn(n, 8, generator=g, dtype=torch.float64) for n in (4, 1, 6)])
    recipe = padless.pair_plan_recipe(cross, s, t, None)
    assert recipe.steps == () and recipe.skipped == 2


def test_recording_leaves_no_trace():
    model = _model()
    marks = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, m in zip(model.parameters(), marks):
        p.grad = m
    state = torch.random.get_rng_state()
    _recipe(model)
    assert all(p.grad is m for p, m in zip(model.parameters(), marks))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_pair_plans_errors():
    with pytest.raises(TypeError, match=r"field 's': pair_plans must be a recipe from padless.pair_plan_recipe"):
        Collator({"s": Field(ragged=0, pair_plans={"heads": 2})})
    recipe = _recipe(_model())
    with pytest.raises(ValueError, match=r"field 's': pair_plans and pad_to_multiple do not mix"):
        Collator({"s": Field(ragged=0, pair_plans=recipe, pad_to_multiple=8)})
    with pytest.raises(ValueError, match=r"field 'z': pair_plans need samples \(N_i, \*static\) ragged along dim 0 only"):
        Collator({**FIELDS, "z": Field(ragged=(0, 1), pair_plans=recipe)})(_samples(NS))
    with pytest.raises(TypeError, match=r"pair_plan_recipe\(\): no input is a NestedTensor ragged along dim 0"):
        padless.pair_plan_recipe(lambda x: x, torch.ones(3))
    z = padless.from_list([torch.ones(2, 2, 3)], ragged_dims=(0, 1))
    with pytest.raises(ValueError, match=r"pair_plan_recipe\(\): field must be tokens \(N_i, \*static\) ragged along dim 0.*\(0, 1\)"):
        padless.pair_plan_recipe(lambda x: x, z, field=z)
