"""The `torchnative` command."""
from __future__ import annotations

import argparse
import sys
import time

import torch


def _demo(args: argparse.Namespace) -> int:
    import torchnative
    from torchnative import models

    model = models.build(args.model, args.size)
    inputs = models.example_inputs(args.model, model)
    print(f"torchnative demo: {args.model} ({args.size} config, random weights), inputs "
          + ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items()))
    delegates = args.delegates.split(",") if args.delegates else None
    with torch.no_grad():
        reference = model(**inputs)
        with torchnative.capture(delegates, compile_after=1):  # placed as a repeated call would be
            explanation = torchnative.explain(model, **inputs)
        torchnative.accelerate(model, delegates=delegates)
        with torchnative.profile() as prof:
            for _ in range(3):  # eager, then compiled, then the same graphs again: replayable
                model(**inputs)
            torchnative.reset_stats()
            t = time.perf_counter()
            out = model(**inputs)
            warm = time.perf_counter() - t
    print(explanation)
    if args.profile:
        print(f"profile of the accelerated calls written to {prof.save(args.profile)}; "
              f"read it with `torchnative inspect {args.profile}`")
    key = "logits" if "logits" in reference else "last_hidden_state"
    diff = (out[key] - reference[key]).abs().max().item()
    same = torch.allclose(out[key], reference[key], rtol=1e-5, atol=1e-5)
    s = torchnative.stats()
    why = "; ".join(s["replay_ineligible"])
    how = "replayed" if s["replays"] else f"recorded{f' (not replayable: {why})' if why else ''}, " \
        f"program cache: {s['cache_hits']} hit(s)"
    print(f"accelerated forward ({warm * 1e3:.1f} ms, {how}): "
          f"{key} {'matches' if same else 'DIFFERS FROM'} eager (max abs diff {diff:.2e})")
    return 0 if same else 1


def _delegates(args: argparse.Namespace) -> int:
    import torchnative

    rows = torchnative.delegates()
    width = max(map(len, rows))
    for name, a in rows.items():
        detail = "; ".join(x for x in (a.reason, f"install: {a.install_hint}" if a.install_hint and a.status != "executes" else "") if x)
        print(f"{name:<{width}}  {a.status:<12}  {detail}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from torchnative.inspector.html import write_html
    from torchnative.inspector.profile import Profile, ProfileError
    from torchnative.inspector.report import console, tables
    from torchnative.inspector.trace import write_trace

    if Path(args.path).is_dir():
        print(f"torchnative inspect: {args.path} is a directory; it reads a profile file written by "
              f"`Profile.save` or `torchnative demo --profile FILE` (bundles are not readable yet)", file=sys.stderr)
        return 2
    try:
        prof = Profile.load(args.path)
    except ProfileError as e:
        print(f"torchnative inspect: {e}", file=sys.stderr)
        return 2
    con = console()
    for item in tables(prof):
        con.print(item)
    if args.html:
        print(f"HTML report: {write_html(prof, args.html)}")
    if args.trace:
        print(f"Chrome trace (open in https://ui.perfetto.dev): {write_trace(prof, args.trace)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from torchnative.models import BUILDERS

    parser = argparse.ArgumentParser(prog="torchnative", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="accelerate a small built-in transformers model and compare with eager")
    demo.add_argument("--model", choices=sorted(BUILDERS), default="gpt2")
    demo.add_argument("--size", choices=["tiny", "base"], default="tiny")
    demo.add_argument("--delegates", default=None, help="comma-separated preference order, e.g. ort")
    demo.add_argument("--profile", metavar="FILE", help="write a profile of the accelerated calls for `torchnative inspect`")
    sub.add_parser("delegates", help="list every delegate and whether it executes here")
    inspect = sub.add_parser("inspect", help="report on a profile: time per delegate, fallbacks, graph breaks")
    inspect.add_argument("path", help="a profile file (JSON) written by Profile.save or demo --profile")
    inspect.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with plots")
    inspect.add_argument("--trace", metavar="FILE", help="also write Chrome trace events (Perfetto)")
    args = parser.parse_args(argv)
    if args.command == "delegates":
        return _delegates(args)
    if args.command == "inspect":
        return _inspect(args)
    if args.command in (None, "demo"):
        if args.command is None:
            args = parser.parse_args(["demo", *(argv or sys.argv[1:])])
        return _demo(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
