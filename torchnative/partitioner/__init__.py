"""CapturedGraph + delegates → partitions (node → delegate), with reasons; each partition as a
graph of its own."""
from torchnative.partitioner.partition import EAGER, Partition, Plan, partition
from torchnative.partitioner.subgraph import Subgraph, extract, written_back

__all__ = ["EAGER", "Partition", "Plan", "partition", "Subgraph", "extract", "written_back"]
