"""Lazy recording at the door (`recorder`) into the trie IR (`trie`) and the CapturedGraph."""
from __future__ import annotations

from torchnative.recording import meta, trie


def reset() -> None:
    """Forget every recorded trie path and inferred shape (a cold start)."""
    trie.ROOT.children.clear()
    meta.forget()
