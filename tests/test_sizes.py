"""Sizes that vary become symbols (torchnative.sizes, cache/templates.py): a graph recorded at
two sizes is fitted into rules, confirmed by a third, and one program compiled for it runs every
size whose graph follows every rule — equal to eager at each; a size that breaks a rule (out of
range, two inputs no longer related as before) is a graph of its own, still exact."""
from __future__ import annotations

import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative import models, sizes
from torchnative.replay import session
from torchnative.cache import templates
from torchnative.cache.program_cache import clear_caches, programs
from torchnative.cache.templates import annotated


class Positional(torch.nn.Module):
    """Integers from its input's length everywhere: a factory (arange), views, a slice."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Embedding(512, 16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, mask):
        n = x.shape[1]
        h = self.proj(x + self.pos(torch.arange(n)))
        h = h.view(1, n, 4, 4).transpose(1, 2).reshape(1, 4, n * 4)
        return torch.tanh(h[:, :, : 2 * n]) * mask[:, None, : 2 * n]


def _inputs(n: int, m: int | None = None) -> tuple:
    g = torch.Generator().manual_seed(n)
    return torch.randn(1, n, 16, generator=g), torch.rand(1, 2 * (m or n), generator=g)


def _compiled(delegate: str = "ort") -> list:
    return [p for p in programs() if any(d == delegate for d, _ in p.partitions)]


def _recorded(monkeypatch, fn, *args) -> list:
    """Each graph `fn` records (recording.trie.Recorded)."""
    seen = []
    real = session.program_for
    monkeypatch.setattr(session, "program_for", lambda graph, *a, **k: seen.append(graph) or real(graph, *a, **k))
    with torch.no_grad(), torchnative.capture(["eager"]):
        out = fn(*args)  # held: a result nobody holds is never computed
    monkeypatch.undo()
    assert out is not None
    return seen


def test_fit_finds_the_rules_and_match_checks_every_one(monkeypatch):
    model = Positional()
    a, b, c, d = (_recorded(monkeypatch, model, *_inputs(n)) for n in (5, 9, 13, 1))
    found = sizes.fit(a[0].flat(), b[0].flat())
    assert found is not None and len(found.defs) == 1  # x's length; the mask's is twice it
    assert [found.match(g[0].flat()) for g in (c, b, a)] == [[13], [9], [5]]
    assert found.match(d[0].flat()) is None  # below the symbol's range (sizes 0 and 1 are specialized)
    (broken,) = _recorded(monkeypatch, model, *_inputs(13, 20))  # the mask no longer twice x's length
    assert found.match(broken.flat()) is None
    # b stands for every size: its integers computed from its inputs' sizes, it runs any of them
    graph = annotated(b[0], found, b[0].flat())
    gm = sizes.symbolic(graph.gm)
    assert any(n.target is torch.ops.aten.sym_size.int for n in gm.graph.nodes)
    assert any(n.target is torch.ops.aten.arange.start_step and isinstance(n.args[1], torch.fx.Node) for n in gm.graph.nodes)


@pytest.mark.parametrize("delegate", ["ort", "xnnpack"])
def test_one_program_runs_every_size_and_equals_eager(delegate):
    """ort compiles the template for every size; XNNPACK (ExecuTorch plans memory for the largest
    size) for the sizes up to a bucket, a program per bucket."""
    model = Positional()
    torchnative.accelerate(model, delegates=[delegate])
    clear_caches()
    torchnative.reset_stats()
    expected = Positional()
    expected.load_state_dict(model.state_dict())
    with torch.no_grad():
        for n in (5, 9, 13, 40, 9, 101, 5):
            for _ in range(2):
                assert_same(model(*_inputs(n)), expected(*_inputs(n)))
    stats = torchnative.stats()
    assert stats["symbolic_graphs"] == 1 and not stats["not_compiled"] and not stats["fallbacks"]
    symbolic = [p for p in programs() if sizes.is_symbolic(p.graph.gm)]
    if delegate == "xnnpack":
        # fitted at 9 (bucket 32: 5, 9, 13), built again at 40 (bucket 128: 40, 101)
        assert sorted(p.bounds[0][1] for p in symbolic) == [32, 128]
        assert all(("xnnpack", 9) in p.partitions for p in symbolic)
    else:
        (symbolic,) = symbolic
        assert symbolic.partitions == (("ort", len(symbolic.graph.op_nodes())),)
        # the first size, compiled at its second run, retired when the fit of the first two sizes
        # compiled at the second's (in its place): the fit's program runs the first size too, and
        # the calls at 5 that replayed the retired one recorded and took it
        assert len(_compiled()) == 1 and stats["evicted"]["programs a template's runs"] == 1


def test_a_size_that_breaks_a_rule_is_a_graph_of_its_own_and_stays_exact():
    model = Positional()
    torchnative.accelerate(model, delegates=["ort"])
    clear_caches()
    torchnative.reset_stats()
    expected = Positional()
    expected.load_state_dict(model.state_dict())
    with torch.no_grad():
        for n in (5, 9, 13):
            model(*_inputs(n))
        built = torchnative.stats()["graphs_built"]
        for args in (_inputs(1), _inputs(13, 20), _inputs(20, 30)):  # out of range; the mask's length otherwise
            for _ in range(2):
                assert_same(model(*args), expected(*args))
    assert torchnative.stats()["graphs_built"] > built  # recorded and compiled as graphs of their own
    # the two whose mask has a length of its own fit a template of their own, in two symbols
    assert torchnative.stats()["symbolic_graphs"] == 2


# xnnpack's (~65 s: a .pte per prompt length's graphs) behind -m slow, as ort's two cover the default run
@pytest.mark.parametrize("name, delegate", [("gpt2", "ort"), ("llama", "ort"),
                                            pytest.param("gpt2", "xnnpack", marks=pytest.mark.slow)])
def test_generate_with_the_default_cache_compiles_once_for_any_prompt(name, delegate):
    """transformers' DynamicCache grows by a token each decode step, and each prompt has its
    length: a template for the prefill and one for the decode step serve them all (on XNNPACK,
    a program per bucket of sizes)."""
    model, reference = models.build(name), models.build(name)
    torchnative.accelerate(model, delegates=[delegate])
    clear_caches()
    torchnative.reset_stats()
    with torch.no_grad():
        for length in (7, 12, 20, 7):
            ids = torch.randint(0, 100, (1, length), generator=torch.Generator().manual_seed(length))
            kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
            expected = reference.generate(ids, **kwargs)
            for _ in range(2):
                assert torch.equal(model.generate(ids, **kwargs), expected)
    stats = torchnative.stats()
    assert stats["symbolic_graphs"] == 2 and not stats["not_compiled"] and not stats["fallbacks"]
    assert len(_compiled(delegate)) <= 4  # the two templates, and the first two prompts' prefills before them
    # a decode step recorded once, at a length whose neighbours recorded the same trace, replays
    # when that length comes again (the second call with a prompt)
    assert stats["replays"] >= 3 * 8


def test_bert_at_five_lengths_compiles_once():
    """Its two graphs (embeddings and the mask's check, then the encoder) each compile once. The
    position table bounds the length: the export finds it, and the templates take no longer one."""
    model, reference = models.build("bert"), models.build("bert")
    torchnative.accelerate(model, delegates=["ort"])
    clear_caches()
    torchnative.reset_stats()
    with torch.no_grad():
        for length in (16, 64, 128, 256, 384):
            inputs = models.example_inputs("bert", model, seq=length)
            assert_same(model(**inputs).last_hidden_state, reference(**inputs).last_hidden_state, rtol=1e-4, atol=1e-5)
    assert torchnative.stats()["symbolic_graphs"] == 2 and not torchnative.stats()["fallbacks"]
    assert len(_compiled()) == 2
    table = model.config.max_position_embeddings
    assert any(p.ranges == {0: (2, table)} for p in _compiled())


def _template_then(delegates: list[str]):
    """explain() of a call at a fourth size, under `delegates`, after an ort-accelerated model ran
    three others: a template that stands for every size is confirmed."""
    pytest.importorskip("coremltools")
    clear_caches()
    model = torchnative.accelerate(Positional(), delegates=["ort"])
    with torch.no_grad():
        for n in (5, 5, 9, 9, 13):  # the second size's compile fits the template, the third confirms it
            model(*_inputs(n))
        with torchnative.capture(delegates, compile_after=1):
            return torchnative.explain(model, *_inputs(17))


def test_explain_names_why_a_static_delegate_declined_the_nodes_of_a_graph_for_every_size():
    """Beside a delegate that takes sizes as symbols, the call's graph is the template's; Core ML
    compiles static shapes, so it declines every op, and explain() says so (it showed the graph's
    placement without a word)."""
    found = _template_then(["coreml", "ort"])
    assert dict(found.partitions[0])["ort"] == 14
    assert "coreml declined 14 op(s): its sizes are symbols" in str(found), found


def test_static_delegates_alone_compile_the_graph_at_the_calls_sizes():
    """Static delegates alone are given the graph at the call's sizes, not the template (where they
    would decline every node): here Core ML converts it (compile-only on Linux: it runs on eager,
    with that reason). Before, a model whose op sequence had run at other sizes in the process (as
    another model of the same code) got nothing on coreml."""
    found = _template_then(["coreml"])
    assert "declined" not in str(found), found
    assert found.fallbacks and all(f.delegate == "coreml" and "compile-only" in f.reason for f in found.fallbacks)
    assert sum(f.n_ops for f in found.fallbacks) >= 10


class Rows(torch.nn.Module):
    """A linear layer over (b, n, 8): its matmul runs on the b·n rows flattened, an integer no
    rule in one symbol describes when b and n both change."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_a_fit_no_third_size_followed_makes_way_for_a_new_one(monkeypatch):
    """Fits of two sizes that no third follows (one batch size's rows beside another's) are
    dropped, oldest first, when a new pair fits: a model called at a new batch size and length
    each time still finds a template for each batch size's lengths."""
    monkeypatch.setattr(templates, "_CANDIDATES", 1)
    model = torchnative.accelerate(Rows(), delegates=["eager"])
    clear_caches()
    torchnative.reset_stats()
    with torch.no_grad():
        for b, n in [(2, 10), (3, 10), (4, 20), (4, 30), (4, 40)]:
            x = torch.randn(b, n, 8)
            assert_same(model(x), torch.tanh(model.linear(x)))
    # (2, 10) and (3, 10) fit (b a symbol) and wait for a third; (4, 20) and (4, 30) fit, and 40 confirms
    assert torchnative.stats()["symbolic_graphs"] == 1, torchnative.stats()


def test_eager_walks_a_graph_for_its_first_runs_then_runs_its_code(monkeypatch):
    """Eager's program walks the graph's nodes for its first two runs (no code generated: ~30 ms a
    500-op graph, more than a graph run once costs) and its generated code after; a template's at
    every size, equal to eager either way."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from torchnative.delegates.eager import Walked

    generated = []
    real = _LazyGraphModule._real_recompile
    monkeypatch.setattr(_LazyGraphModule, "_real_recompile", lambda self: generated.append(self) or real(self))
    model = Positional()
    expected = Positional()
    expected.load_state_dict(model.state_dict())
    torchnative.accelerate(model, delegates=["eager"], replay=False)
    clear_caches()
    with torch.no_grad():
        for n in (5, 9, 13, 40, 9, 101, 5, 77):
            assert_same(model(*_inputs(n)), expected(*_inputs(n)))
    runners = [s.run for p in programs() for s in p.steps]
    assert runners and all(type(r) is Walked for r in runners)
    template = [r for p in programs() for r in (s.run for s in p.steps) if sizes.is_symbolic(p.graph.gm)]
    assert len(template) == 1 and template[0].runs > 2 and template[0].forward is not None  # ran 13..77: its code
    once = [r for r in runners if r.runs == 1]
    assert once and all(r.forward is None for r in once)  # a size run once: walked, no code
    assert len(generated) == sum(r.forward is not None for r in runners)  # the code of those run more than twice, once each
    assert all(r.forward.__name__ == "forward" for r in runners if r.forward is not None)  # not the lazy one
