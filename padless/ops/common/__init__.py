"""Helpers shared by every op family; no handler is registered here.

* :mod:`~padless.ops.common.structure`: dim bookkeeping and building new structures
* :mod:`~padless.ops.common.host`: host-side structure of a batch, reshape targets
* :mod:`~padless.ops.common.engine`: the generic pointwise engine (dense operands onto rows)
* :mod:`~padless.ops.common.segment`: segmented reductions over groups of rows
* :mod:`~padless.ops.common.broadcast`: broadcast plans that create pair axes
* :mod:`~padless.ops.common.carried`: row maps carried through ``torch.compile``
* :mod:`~padless.ops.common.size_groups`: dense ops batched by sample shape
* :mod:`~padless.ops.common.seq_first`: the sequence-first view of batch_first modules
* :mod:`~padless.ops.common.padded`: dense operands in padded coordinates, the strict switch
"""
