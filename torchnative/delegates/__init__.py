"""Delegates: one module per target. Each has `available()`, and `compile(graph)` → callable."""
