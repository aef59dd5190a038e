"""Bounded memory (issue 36, 37): every table that grows with what a process runs keeps a limit and
drops the least recently used entries; dropping one never changes a result."""
import torch

import torchnative
from torchnative.cache.program_cache import CACHE, LIMIT, programs
from torchnative.recording import trie


def _chain(depth: int):
    def f(x):
        for _ in range(depth):
            x = (x * 1.5).sin()
        return x + 1
    return f


def test_a_small_program_cache_evicts_and_results_stay_eager_s():
    """Five graphs (chains of 1..5 ops) in turn, twice, under a cache of two graphs: programs are
    dropped and built again, and every result is eager's."""
    x = torch.randn(4, 8)
    expected = {depth: _chain(depth)(x) for depth in range(1, 6)}
    CACHE.clear()
    torchnative.set_memory_limit(2)
    torchnative.reset_stats()
    try:
        with torch.no_grad(), torchnative.capture(["ort"], compile_after=1):
            for _ in range(2):
                for depth in range(1, 6):
                    torch.testing.assert_close(_chain(depth)(x), expected[depth], rtol=1e-5, atol=1e-6)
        assert len(programs()) <= 2
        assert torchnative.stats()["evicted"]["programs"] >= 8
    finally:
        torchnative.set_memory_limit(LIMIT)


def test_the_trie_starts_over_past_its_limit_and_results_stay_eager_s(monkeypatch):
    """Many sizes, each a new trie path: the trie stays within its limit, results are eager's."""
    monkeypatch.setattr(trie, "LIMIT", 50)
    torchnative.reset_stats()
    for n in range(1, 40):
        x = torch.randn(n, 3)
        expected = _chain(3)(x)
        with torch.no_grad(), torchnative.capture(["eager"]):
            torch.testing.assert_close(_chain(3)(x), expected)
        assert trie._nodes <= 50 + 20
    assert torchnative.stats()["evicted"]["trie nodes"] > 0
