"""Graphs that stand for every size (torchnative.sizes): a recorded graph whose op sequence was
recorded before at another size is fitted against that one, and the rules the fit found are a
*template*: one program, compiled once from the matching graph at hand, runs every graph that
matches it (torch.compile's automatic dynamic: static at first, symbolic once sizes change); a
delegate that plans memory for the largest size (xnnpack) takes sizes up to a bucket, and the
template gets a program per bucket. A fit of two
sizes is a candidate until a graph at a third size matches it, or one of the two would compile
(then the candidate compiles in its place): two samples fit an integer that grows quadratically
too, and a template compiled for it would serve no other size.

Which graphs are the same op sequence is the `skeleton`: the ops in order and the inputs' ranks
and dtypes. A graph that matches no template and fits none of the recent graphs of its skeleton
stays a graph of its own size."""
from __future__ import annotations

from dataclasses import dataclass

from torchnative import events
from torchnative.ir import CapturedGraph
from torchnative.lru import Lru
from torchnative.recording.trie import Recorded
from torchnative.sizes import SIZES, Flat, Sizes, fit

_RECENT = 4  # graphs of a skeleton kept to fit a new size against
_CANDIDATES = 8  # fits of a skeleton not confirmed (sizes that follow no rule fit pairwise)


@dataclass(eq=False)
class Template:
    sizes: Sizes  # the rules fitted to two graphs' integers (the later one's): they stand for every match
    fitted: set  # the two graphs (Recorded)
    confirmed: bool = False  # a graph at a third size matched it, or one of the two compiled
    made = 0  # templates made in this process: each one's `serial`

    def __post_init__(self) -> None:
        self.serial = Template.made
        Template.made += 1

    def narrow(self, ranges: dict[int, tuple[int, int]]) -> None:
        """Sizes out of these ranges (what a program's delegates took) match it no more."""
        self.sizes = self.sizes.narrowed(ranges)


class Templates:
    """The templates of every skeleton, and what fitting needs: per skeleton its recent graphs, per
    graph its skeleton and the template it matched. Owned by the program cache; every table bounded."""

    def __init__(self, limit: int):
        self.skeletons = Lru(4 * limit, "skeletons")  # graph -> its skeleton
        # per skeleton: its recent graphs at distinct sizes, flattened (torchnative.sizes), to fit against
        self.recent = Lru(limit, "recent sizes")
        self.templates = Lru(limit, "templates")
        # graph -> its template, or None with the serial the next template would have had then
        # (one made later, from two other sizes, may match it)
        self.matched = Lru(4 * limit, "matched sizes")

    def tables(self) -> list[Lru]:
        return [self.skeletons, self.recent, self.templates, self.matched]

    def skeleton(self, graph: Recorded) -> tuple:
        found = self.skeletons.get(graph)
        if found is None:
            found = self.skeletons[graph] = graph.skeleton()
        return found

    def template_for(self, graph: Recorded) -> Template | None:
        """The template this graph matches: a confirmed one, or a candidate (which a match at a
        third size confirms); else None, after fitting the graph against a recent graph of its
        skeleton at another size (a candidate it matches)."""
        seq = self.skeleton(graph)
        templates = self.templates.get(seq, ())
        found, known = self.matched.get(graph, (None, -1))
        if found is None and (known < 0 or any(t.serial >= known for t in templates)):
            flat = graph.flat()
            found = next((t for t in templates if t.serial >= known and t.sizes.match(flat) is not None), None)
            if found is not None and graph not in found.fitted:  # a third size follows the rules two others made
                confirm(found)
            if found is None and known < 0:
                found = self._candidate(seq, graph, flat)
            self.matched[graph] = (found, Template.made)
        return found

    def _candidate(self, seq: tuple, graph: Recorded, flat: Flat) -> Template | None:
        """A template fitted from this graph and a recent graph of its skeleton at another size,
        which this graph itself matches; None when none fits."""
        made = None
        kept = self.templates.setdefault(seq, [])
        for other, other_flat in reversed(self.recent.get(seq, ())):
            sizes = fit(other_flat, flat)
            if sizes is not None:
                # the oldest fit no third size followed makes way (GPT-2 at a new batch size and
                # length each call leaves fits of one batch size's lengths behind)
                candidates = [t for t in kept if not t.confirmed]
                if len(candidates) >= _CANDIDATES:
                    kept.remove(candidates[0])
                made = Template(sizes, {other, graph})
                kept.append(made)
                break
        recent = self.recent.setdefault(seq, [])
        recent.append((graph, flat))
        del recent[:-_RECENT]
        return made


def confirm(template: Template) -> None:
    if not template.confirmed:
        template.confirmed = True
        events.STATS.symbolic_graphs += 1


def annotated(recorded: Recorded, sizes: Sizes, flat: Flat) -> CapturedGraph:
    """The recorded graph, each node's integers that follow a symbol marked with their rules
    (`node.meta["sizes"]`, torchnative.sizes)."""
    made: list = []
    graph = recorded.graph(made)
    for rule, at in zip(sizes.rules, flat.where):
        if rule.symbol < 0:
            continue
        call, outputs = made[at[0]]
        target, where = (call, (at[1], *at[2:])) if at[1] in ("args", "kwargs") else (outputs[at[2]], at[3:])
        target.meta.setdefault(SIZES, {})[where] = rule
    return graph
