"""The README and docs/ hold to the code: its examples run, and every name, counter, setting, file
and link they mention exists."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchnative

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _text(page: Path) -> str:
    return page.read_text()


def _blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _text(page), re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_point_at_pages_and_sections_that_exist(page):
    for target, anchor in re.findall(r"\]\(([^)#]*)(?:#([^)]+))?\)", _text(page)):
        linked = (page.parent / target) if target else page
        assert linked.is_file(), f"{page.name} links to {target}, which does not exist"
        if anchor:
            headings = [re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                        for h in re.findall(r"^#+ (.*)$", _text(linked), re.M)]
            assert anchor in headings, f"{page.name} links to {target}#{anchor}; its sections: {headings}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_names_counters_settings_and_files_exist(page):
    text = _text(page)
    for name in re.findall(r"torchnative\.([a-z_]+)\(", text):
        assert name in torchnative.__all__, f"{page.name} calls torchnative.{name}, which is not public"
    counters = torchnative.stats()
    for key in re.findall(r'stats\(\)\["(\w+)"\]', text):
        assert key in counters, f"{page.name} names stats()[{key!r}]: the counters are {sorted(counters)}"
    code = "\n".join(p.read_text() for p in (ROOT / "torchnative").rglob("*.py"))
    for setting in set(re.findall(r"TORCHNATIVE_[A-Z_]+", text)):
        assert setting in code, f"{page.name} names {setting}, which the code never reads"
    for path in re.findall(r"`((?:torchnative|tests|benchmarks|delegates|bundle)/[\w/]+\.py)", text):
        candidates = [ROOT / path, ROOT / "torchnative" / path]
        assert any(c.is_file() for c in candidates), f"{page.name} names {path}, which does not exist"


def test_the_readme_starts_with_the_two_setup_commands_and_is_short():
    readme = ROOT / "README.md"
    setup = _blocks(readme, "bash")[0].strip().splitlines()
    assert len(setup) == 2 and setup[0].endswith("torchnative capture-and-compile") and setup[1] == "python -m pytest"
    assert len(_text(readme).splitlines()) <= 100, "the README grew: behaviour belongs in docs/"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pytest" in ci


@pytest.mark.slow  # 16 s; the default suite stays under ~18 min on 2 cores
def test_the_readmes_python_examples_run(tmp_path):
    """The accelerate/capture block and the inspector block, one after the other, as a user pastes them."""
    blocks = _blocks(ROOT / "README.md", "python")
    accelerate, inspector = blocks[0], blocks[-1]
    done = subprocess.run([sys.executable, "-c", accelerate + inspector], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "TORCHNATIVE_CACHE_DIR": "off"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run.json").is_file()
    assert "graph" in done.stdout  # explain's text
