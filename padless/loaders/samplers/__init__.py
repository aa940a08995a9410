"""Batch samplers: random, bucketed, budget-packed; deterministic, rank-aware, resumable.

Every sampler yields lists of dataset indices (use it as ``DataLoader(batch_sampler=...)``)
and has ``set_epoch``, ``state_dict``/``load_state_dict``, ``__len__`` and
``rank``/``world_size``; see :mod:`padless.loaders.samplers.base` for the rules.
"""

from padless.loaders.samplers.base import BatchSamplerBase, next_fit
from padless.loaders.samplers.bucket import BucketBatchSampler
from padless.loaders.samplers.budget import BudgetBatchSampler
from padless.loaders.samplers.random_batches import RandomBatchSampler

__all__ = ["BatchSamplerBase", "BucketBatchSampler", "BudgetBatchSampler", "RandomBatchSampler", "next_fit"]
