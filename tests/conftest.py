import os

import pytest
import torch

import padless  # noqa: F401  (registers handlers)

torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    if os.environ.get("PADLESS_KEEP_DYNAMO") is None:
        torch._dynamo.reset()
