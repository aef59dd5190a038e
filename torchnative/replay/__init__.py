"""Replaying whole calls: the capture session, the tracer that describes a recorded call as a
`Trace`, the guards a trace is valid for, and the interpreter that runs one."""
