"""The reference executor: a captured graph's own aten ops on real tensors. Takes every node."""
from __future__ import annotations

import torch.fx as fx

from torchnative.interface import YES, Artifact, Availability, Runner, Support
from torchnative.ir import CapturedGraph
from torchnative.sizes import symbolic


class Eager:
    name = "eager"
    external_weights = False
    writes_in_place = True  # it runs the graph as code: index_put_ writes the caller's tensor
    composites: frozenset[str] = frozenset()
    toolchain = ("torch",)
    extension = "pt2"
    calibrates = False
    dynamic = True  # torchnative.sizes.symbolic computes the sizes the graph names from its inputs

    def available(self) -> Availability:
        return Availability("executes")

    def supports(self, node: fx.Node) -> Support:
        return YES

    def compile(self, graph: CapturedGraph) -> Artifact:
        # the artifact is the subgraph itself; the GraphModule object rides along in memory so
        # that loading in the same process does not re-trace it
        return Artifact(self.name, graph.gm.code.encode(), live=graph)

    def load(self, artifact: Artifact) -> Runner:
        forward = symbolic(artifact.live.gm).forward  # integers that follow a symbol from sizes
        return lambda inputs: forward(*inputs)


delegate = Eager()
