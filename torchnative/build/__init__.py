"""Building programs (DESIGN.md §6): a captured graph prepared, partitioned, lowered per partition
(disk-cached), loaded, and assembled into a `Program` that runs its partitions in order."""
