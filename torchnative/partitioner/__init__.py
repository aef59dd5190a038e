"""CapturedGraph + delegates → partitions (node → delegate), with reasons."""
from torchnative.partitioner.partition import EAGER, Partition, Plan, partition

__all__ = ["EAGER", "Partition", "Plan", "partition"]
