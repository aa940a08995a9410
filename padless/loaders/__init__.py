"""Dataset readers and batch samplers for variable-size data.

Readers yield samples at their native size (dicts of tensors, images as
``(C, H, W)`` uint8 channel-last views of the decoded pixels) for the collator to pack; samplers choose which samples
share a batch. Optional packages (pillow, webdataset, datasets) are imported
only when a reader needs them (``pip install 'padless[loaders]'``).

* samplers: :class:`RandomBatchSampler`, :class:`BucketBatchSampler`,
  :class:`BudgetBatchSampler`: deterministic per ``(seed, epoch)``, disjoint and
  equally long per rank, resumable mid-epoch (``state_dict``/``load_state_dict``);
* constraints: :class:`BatchSize`, :class:`TokenBudget`, :class:`PixelBudget`,
  :class:`PairBudget`, :class:`CostFn` (subclass :class:`Constraint` for a new cost);
* readers: :class:`WebDatasetReader` (tar shards), :class:`HFDatasetReader`
  (Hugging Face ``datasets``), :class:`ImageFolder`;
* streams: :class:`StreamingBucketer`, :class:`BucketedStream`, :class:`Shuffle`;
* transforms (the readers' ``transform=`` hook): :class:`Normalize`,
  :func:`resize_to_budget` / :func:`budget_size` / :func:`budget_sizes`, :class:`Compose`;
* errors: :class:`SkipAndWarn` (default), :func:`raise_error`, :class:`SampleError`;
  ``reader.skipped`` (a :class:`SkipStats`) counts the skipped samples per epoch in the
  main process, DataLoader workers' included;
  shards that end early reach the handler as :class:`TruncatedShardError`, images
  over ``max_pixels`` as :class:`ImageTooLargeError`.

>>> from padless.loaders import BudgetBatchSampler, TokenBudget
>>> lengths = [30, 5, 17, 40, 8, 22]
>>> sampler = BudgetBatchSampler(lengths, TokenBudget(64), seed=0)
>>> all(sum(lengths[i] for i in b) <= 64 for b in sampler)
True
"""

from padless.loaders.constraints import (
    BatchSize,
    Constraint,
    CostFn,
    PairBudget,
    PixelBudget,
    TokenBudget,
    as_sizes,
)
from padless.loaders.distributed import Consumer, current_consumer, rank_and_world_size, worker_id_and_count
from padless.loaders.errors import SampleError, SkipAndWarn, raise_error, skip_silently
from padless.loaders.hf import HFDatasetReader
from padless.loaders.image_folder import ImageFolder
from padless.loaders.images import (
    DEFAULT_MAX_PIXELS,
    ImageTooLargeError,
    NotARegularFileError,
    UnsupportedImageFormatError,
    decode_image,
    target_size,
)
from padless.loaders.skips import SkipStats
from padless.loaders.samplers import BatchSamplerBase, BucketBatchSampler, BudgetBatchSampler, RandomBatchSampler
from padless.loaders.streaming import BucketedStream, Shuffle, StreamingBucketer, fixed_length, shuffle_buffer
from padless.loaders.tarstream import MemberTooLargeError, TrailingDataError, TruncatedShardError, UnsupportedMemberError
from padless.loaders.transforms import Compose, FieldTransforms, Normalize, budget_size, budget_sizes, resize_to_budget
from padless.loaders.webdataset import DuplicateMemberError, WebDatasetReader
from padless.loaders.schedules import BudgetSchedule, ScheduledResize

__all__ = [
    "BatchSamplerBase",
    "BatchSize",
    "BucketBatchSampler",
    "BucketedStream",
    "Compose",
    "DEFAULT_MAX_PIXELS",
    "DuplicateMemberError",
    "FieldTransforms",
    "ImageTooLargeError",
    "MemberTooLargeError",
    "NotARegularFileError",
    "Normalize",
    "BudgetBatchSampler",
    "BudgetSchedule",
    "ScheduledResize",
    "Constraint",
    "Consumer",
    "CostFn",
    "HFDatasetReader",
    "ImageFolder",
    "PairBudget",
    "PixelBudget",
    "RandomBatchSampler",
    "SampleError",
    "Shuffle",
    "SkipAndWarn",
    "SkipStats",
    "StreamingBucketer",
    "TokenBudget",
    "TrailingDataError",
    "TruncatedShardError",
    "UnsupportedImageFormatError",
    "UnsupportedMemberError",
    "WebDatasetReader",
    "as_sizes",
    "budget_size",
    "budget_sizes",
    "current_consumer",
    "decode_image",
    "fixed_length",
    "raise_error",
    "rank_and_world_size",
    "resize_to_budget",
    "shuffle_buffer",
    "skip_silently",
    "target_size",
    "worker_id_and_count",
]
