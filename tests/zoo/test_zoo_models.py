"""A few zoo models, unchanged, agree sample by sample with the model run on each sample alone.

The builders, batches and checks are ``benchmarks/zoo_models.py``'s (``make zoo`` runs the
full table with them in its own environment, ``zoo/.venv``). Each test needs its model package; where it is not
installed (the test environment installs none of them) the test is skipped and says so. To
run them: ``zoo/.venv/bin/python -m pytest tests/zoo`` after ``make zoo``.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _zoo():
    name = "zoo_models"  # the name benchmarks/zoo.py imports it by
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "zoo_models.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _needs(package: str) -> None:
    pytest.importorskip(
        package, reason=f"{package} is not installed here; the zoo models run in zoo/.venv (make zoo)"
    )


def _case(name: str):
    (case,) = [c for c in _zoo().all_cases() if c.name == name]
    return case


def _agree(name: str, samples: list, tol: float) -> None:
    zoo = _zoo()
    case = _case(name)
    model = case.build().eval()
    diff = zoo.per_sample_diff(case, model, samples)
    assert diff < tol, f"{name}: max per-sample difference {diff:.2e} (tolerance {tol:.0e})"


def test_timm_resnet18_per_sample():
    _needs("timm")
    _agree("timm resnet18", _zoo().image_samples(0, b=3, lo=40, hi=72), 1e-4)


def test_bert_inputs_embeds_per_sample():
    _needs("transformers")
    _agree("transformers BERT (inputs_embeds=nt)", _zoo().token_samples(0, b=3, lo=5, hi=24), 1e-4)


def test_pairformer_layer_per_sample():
    _needs("boltz")
    _needs("einops")
    _agree("boltz PairformerLayer", _zoo().pair_samples(0, b=3, lo=5, hi=12), 1e-4)


def test_torchrec_ebc_per_sample():
    _needs("torchrec")
    _agree("torchrec EmbeddingBagCollection", _zoo().id_samples(0, b=4, hi=16), 1e-5)


def test_pairformer_layer_gradients():
    _needs("boltz")
    _needs("einops")
    zoo = _zoo()
    case = _case("boltz PairformerLayer")
    model = case.build().eval()
    diff = zoo.grad_diff(case, model, zoo.pair_samples(1, b=2, lo=4, hi=9))
    assert diff < 1e-4, f"PairformerLayer: max parameter-gradient difference {diff:.2e}"


def test_occupancy_counts_real_over_envelope():
    zoo = _zoo()
    assert zoo.occupancy([(2, 4), (4, 2)]) == pytest.approx(16 / 32)
    assert zoo.occupancy([(3,), (3,)]) == 1.0
    assert torch.equal(zoo.pad_pairs([torch.ones(1, 1, 2), torch.ones(2, 2, 2)])[0].sum((-1,)), torch.tensor([[2.0, 0.0], [0.0, 0.0]]))


def test_lstm_tagger_per_sample_and_gradients():
    """torch's own modules only: runs here, no zoo package needed."""
    zoo = _zoo()
    case = _case("torch LSTM tagger (nn.LSTM on nt)")
    ids = zoo.id_seqs(0, b=3, lo=2, hi=12)
    _agree(case.name, ids, 1e-5)
    diff = zoo.grad_diff(case, case.build().eval(), ids)
    assert diff < 1e-5, f"LSTM tagger: max parameter-gradient difference {diff:.2e}"
    case.padded_loss(case.build(), ids).backward()  # the pack_padded_sequence baseline runs


def test_sequence_first_encoder_per_sample_and_gradients():
    """torch's nn.TransformerEncoder with batch_first=False fed (T, B, E): no zoo package needed."""
    zoo = _zoo()
    case = _case("torch TransformerEncoder, sequence-first (T, B, E)")
    ids = zoo.id_seqs(0, b=3, lo=1, hi=12)
    _agree(case.name, ids, 1e-5)
    diff = zoo.grad_diff(case, case.build().eval(), ids)
    assert diff < 1e-5, f"sequence-first encoder: max parameter-gradient difference {diff:.2e}"
    case.padded_loss(case.build(), ids).backward()  # the src_key_padding_mask baseline runs
