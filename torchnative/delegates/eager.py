"""The reference executor: a captured graph's own aten ops on real tensors."""
from __future__ import annotations

from typing import Callable

import torch

from torchnative.ir import CapturedGraph

name = "eager"


def available() -> tuple[str, str]:
    return "executes", "upstream torch ops"


def compile(graph: CapturedGraph) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    forward = graph.gm.forward
    return lambda inputs: forward(*inputs)
