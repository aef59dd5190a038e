"""`torchnative demo`: accelerate a small built-in model and compare with eager."""
from __future__ import annotations

import time

import click
import torch

from torchnative.models import ARCHITECTURES


@click.command("demo")
@click.option("--model", type=click.Choice(sorted(ARCHITECTURES)), default="gpt2", show_default=True)
@click.option("--size", type=click.Choice(["tiny", "base"]), default="tiny", show_default=True)
@click.option("--delegates", default=None, help="comma-separated preference order, e.g. ort")
@click.option("--profile", metavar="FILE", default=None, help="write a profile of the accelerated calls for `torchnative inspect`")
def demo(model: str = "gpt2", size: str = "tiny", delegates: str | None = None, profile: str | None = None) -> int:
    """Accelerate a small built-in transformers model and compare with eager."""
    import torchnative
    from torchnative import models

    name = model
    model = models.build(name, size)
    inputs = models.example_inputs(name, model)
    click.echo(f"torchnative demo: {name} ({size} config, random weights), inputs "
               + ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items()))
    chosen = delegates.split(",") if delegates else None
    with torch.no_grad():
        reference = model(**inputs)
        with torchnative.capture(chosen, compile_after=1):  # placed as a repeated call would be
            explanation = torchnative.explain(model, **inputs)
        torchnative.accelerate(model, delegates=chosen)
        with torchnative.profile() as prof:
            for _ in range(3):  # eager, then compiled, then the same graphs again: replayable
                model(**inputs)
            torchnative.reset_stats()
            t = time.perf_counter()
            out = model(**inputs)
            warm = time.perf_counter() - t
    click.echo(explanation)
    if profile:
        click.echo(f"profile of the accelerated calls written to {prof.save(profile)}; "
                   f"read it with `torchnative inspect {profile}`")
    key = "logits" if "logits" in reference else "last_hidden_state"
    diff = (out[key] - reference[key]).abs().max().item()
    same = torch.allclose(out[key], reference[key], rtol=1e-5, atol=1e-5)
    s = torchnative.stats()
    why = "; ".join(s["replay_ineligible"])
    how = "replayed" if s["replays"] else f"recorded{f' (not replayable: {why})' if why else ''}, " \
        f"program cache: {s['cache_hits']} hit(s)"
    click.echo(f"accelerated forward ({warm * 1e3:.1f} ms, {how}): "
               f"{key} {'matches' if same else 'DIFFERS FROM'} eager (max abs diff {diff:.2e})")
    return 0 if same else 1
