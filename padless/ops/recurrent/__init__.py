"""Recurrent: ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` on a NestedTensor of ``(L_i, E)`` sequences.

The modules call ``torch.lstm`` / ``torch.gru`` / ``torch.rnn_tanh`` / ``torch.rnn_relu``
(``torch._VF``), which reach ``NestedTensor.__torch_function__``. The handlers (``modules``) run
the ``PackedSequence`` form of the rows with the module's own weights: through padless's own
recurrence (``loop``) on the CPU when autograd records the step, through torch's packed kernel
otherwise (cuDNN on CUDA, exactly as for ``pack_padded_sequence``).
"""

from padless.ops.recurrent import modules  # noqa: F401  (registers the handlers)
