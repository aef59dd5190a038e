"""Deciding when to build: the `ProgramCache` that owns every per-graph, per-size and per-template
table (bounded, least recently used evicted), templates of sizes that vary, calibration sets."""
