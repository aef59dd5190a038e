"""Lazy recording at the door (`recorder`) into the trie IR (`trie`) and the CapturedGraph."""
from __future__ import annotations

from torchnative.recording import meta, scalars, trie


def reset() -> None:
    """Forget every recorded trie path, inferred shape and scalar site (a cold start)."""
    trie.forget()
    scalars.forget()
    meta.forget()
