"""Running a lowered program: a runner that executes the graph's remaining nodes in order, each
through its candle lowering, on a list of slots; and candle errors and panics as RuntimeErrors."""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from torchnative.delegates.hf_candle.lowerings import LOWER, out_of
from torchnative.delegates.hf_candle.transfer import to_candle, to_torch
from torchnative.interface import Runner
from torchnative.ir import CapturedGraph, is_weight


def interpreter(graph: CapturedGraph, folded: set[str], constants: dict, delegate: str) -> Runner:
    """A runner that executes the graph's remaining nodes in order on a list of slots."""
    slots: dict[fx.Node, int] = {}
    env0: list = []
    steps = []
    inputs = []
    for n, role in zip(graph.placeholders(), graph.input_roles):
        if not is_weight(role):
            inputs.append(len(env0))
            slots[n] = len(env0)
            env0.append(None)
    for n in graph.gm.graph.nodes:
        if n.name in constants:
            slots[n] = len(env0)
            env0.append(constants[n.name])
        elif n.op == "call_function" and n.name not in folded:
            fn = LOWER[n.target] if n.target is not operator.getitem else (lambda o, x, i: x[i])
            args = [_fetcher(a, slots) for a in n.args]
            kwargs = {k: _fetcher(a, slots) for k, a in n.kwargs.items()}
            slots[n] = len(env0)
            env0.append(None)
            steps.append((n, functools.partial(fn, out_of(n)), args, kwargs, slots[n]))
    out_nodes = graph.outputs()
    outputs = [slots[n] for n in out_nodes]
    kinds = [(tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in out_nodes]
    expanded = {i: n.meta["val"].stride() for i, n in enumerate(out_nodes)
                if any(st == 0 and size > 1 for st, size in zip(n.meta["val"].stride(), n.meta["val"].shape))}

    def runner(values: list[torch.Tensor]) -> list[torch.Tensor]:
        env = list(env0)
        node = None
        try:
            for i, c in zip(inputs, to_candle(values)):
                env[i] = c
            for node, fn, args, kwargs, slot in steps:
                env[slot] = fn(*[a(env) for a in args], **{k: a(env) for k, a in kwargs.items()})
            node = None
            out = to_torch([env[i] for i in outputs], kinds)
            for i, stride in expanded.items():
                out[i] = _expanded(out[i], stride)
            return out
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # candle panics surface as pyo3's PanicException, a BaseException
            where = f"{node.target} ({node.name})" if node is not None else "moving tensors in or out"
            raise failure(delegate, where, e) from e

    return runner


def _expanded(dense: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """dense laid out as eager's expanded output (strides of 0). The runtime gives outputs eager's
    strides by copying into torch.empty_strided, which torch refuses for overlapping layouts; the
    values along a 0-stride dimension are all equal, so one slice of them is all there is to copy."""
    out = torch.empty_strided(dense.shape, stride, dtype=dense.dtype)
    one = tuple(slice(None) if s else slice(0, 1) for s in stride)
    out[one].copy_(dense[one])
    return out


def failure(delegate: str, where: str, e: BaseException) -> RuntimeError:
    """A candle error or panic as a RuntimeError naming the delegate and the op, without the Rust
    backtrace that candle appends when RUST_BACKTRACE is set."""
    message = str(e).removeprefix("WithBacktrace { inner: ").split(", backtrace:")[0].split("\n")[0]
    return RuntimeError(f"{delegate}: {where} failed: {type(e).__name__}: {message}")


def _fetcher(arg: Any, slots: dict) -> Callable[[list], Any]:
    """How a step reads one argument from the slots: a node's value, a list of them, or a literal."""
    if isinstance(arg, fx.Node):
        i = slots[arg]
        return lambda env: env[i]
    if isinstance(arg, (list, tuple)) and any(isinstance(a, fx.Node) for a in arg):
        parts = [_fetcher(a, slots) for a in arg]
        return lambda env: [p(env) for p in parts]
    return lambda env: arg
