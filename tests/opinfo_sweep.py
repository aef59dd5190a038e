"""PyTorch's OpInfo samples (float32, CPU) under capture() compared with eager.

Run as a script so that a crash in one sample is a reported failure, not a dead test process:
    python tests/opinfo_sweep.py [--samples N] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

import torchnative

warnings.filterwarnings("ignore")

# uninitialized memory: no two runs agree, eager included
_NONDETERMINISTIC = ("empty", "new_empty", "new_empty_strided", "empty_like", "empty_strided", "empty_permuted")


def _clone(x):
    return torch.utils._pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, x)


def _plain(x):
    """Lazy wrappers → their real values, so comparison runs outside the door."""
    return torch.utils._pytree.tree_map(
        lambda t: t.materialize("compare") if type(t) is torchnative.LazyTensor else t, x)


REL_L2: float | None = None  # --rel-l2: a quantizing delegate is compared by relative L2 error
WORST = [0.0]                 # the largest relative L2 error accepted under --rel-l2


def _same(a, b) -> str | None:
    ta, tb = torch.utils._pytree.tree_flatten(a), torch.utils._pytree.tree_flatten(b)
    if ta[1] != tb[1]:
        return f"structure {ta[1]} != {tb[1]}"
    for x, y in zip(ta[0], tb[0]):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"types {type(x).__name__} != {type(y).__name__}"
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                return f"meta {x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}"
            if REL_L2 is not None and x.dtype.is_floating_point and x.numel():
                err = ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-12)).item()
                if not err <= REL_L2:
                    return f"relative L2 error {err:.3g} > {REL_L2}"
                WORST[0] = max(WORST[0], err)
                continue
            try:
                torch.testing.assert_close(x, y, equal_nan=True)
            except AssertionError as e:
                return "values: " + str(e).splitlines()[1 if len(str(e).splitlines()) > 1 else 0]
        elif x != y and not (isinstance(x, float) and x != x and y != y):
            return f"value {x!r} != {y!r}"
    return None


def run_sample(op, sample, delegates=None) -> tuple[str, str]:
    """('pass'|'fail'|'skip', detail)."""
    args = (sample.input, *sample.args)
    kwargs = sample.kwargs
    try:
        eargs, ekw = _clone((args, kwargs))
        torch.manual_seed(0)
        expected = op.op(*eargs, **ekw)
    except Exception as e:
        return "skip", f"eager raises {type(e).__name__}"
    cargs, ckw = _clone((args, kwargs))
    torchnative.reset_stats()
    placed = []
    stop = torchnative.events.listen(lambda e: placed.extend(
        d for d, _ in e.partitions) if isinstance(e, torchnative.events.GraphRun) else None)
    try:
        torch.manual_seed(0)
        with torchnative.capture(delegates, compile_after=1):
            got = op.op(*cargs, **ckw)
        got = _plain(got)
    except Exception as e:
        stop()
        return "fail", f"capture raises {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    stop()
    # both sides through the same tree_map, which also normalizes containers (Size -> tuple)
    why = _same(got, _plain(expected)) or _same(_plain((cargs, ckw)), _plain((eargs, ekw)))
    if why:
        return "fail", why
    fallbacks = torchnative.stats()["fallbacks"]
    # a compile-only delegate (Core ML off macOS) converted and validated it, then eager ran it
    converted = [f for f in fallbacks if ": compile-only on this platform" in f]
    if len(converted) < len(fallbacks):  # claimed by a delegate that then could not compile or run it
        return "fallback", "; ".join(f for f in fallbacks if f not in converted)[:300]
    return "pass", "delegated" if converted or any(d != "eager" for d in placed) else ""


def sweep(max_samples: int | None, names: set[str] | None = None, delegates=None) -> dict:
    from torch.testing._internal.common_methods_invocations import op_db

    results = {"pass": 0, "fail": 0, "skip": 0, "fallback": 0, "failures": [], "fallbacks": [], "delegated": []}
    for op in op_db:
        if names is not None and op.name not in names:
            continue
        if torch.float32 not in op.supported_dtypes("cpu") or op.name in _NONDETERMINISTIC:
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32))
        except Exception:
            continue
        for i, sample in enumerate(samples[:max_samples]):
            status, detail = run_sample(op, sample, delegates)
            results[status] += 1
            if detail == "delegated":
                results["delegated"].append(f"{op.name}[{op.variant_test_name}]#{i}")
            if status in ("fail", "fallback"):
                results[status + "s" if status == "fallback" else "failures"].append(
                    f"{op.name}[{op.variant_test_name}]#{i}: {detail}")
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=None, help="samples per op (default: all)")
    p.add_argument("--out", default=None)
    p.add_argument("--delegates", default=None, help="comma-separated, e.g. ort")
    p.add_argument("--ops", default=None, help="comma-separated OpInfo names (default: all)")
    p.add_argument("--rel-l2", type=float, default=None, help="compare floats by relative L2 error (quantizing delegates)")
    a = p.parse_args()
    global REL_L2
    REL_L2 = a.rel_l2
    t = time.time()
    r = sweep(a.samples, set(a.ops.split(",")) if a.ops else None, a.delegates.split(",") if a.delegates else None)
    r["seconds"] = round(time.time() - t, 1)
    r["worst_rel_l2"] = WORST[0] if REL_L2 is not None else None
    ran = r["pass"] + r["fail"] + r["fallback"]
    r["pass_rate"] = r["pass"] / ran if ran else 0.0
    text = json.dumps(r, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(f"{r['pass']} passed, {r['fail']} failed, {r['fallback']} fell back, {r['skip']} skipped (eager raises) "
          f"= {100 * r['pass_rate']:.1f}% in {r['seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
