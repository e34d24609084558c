"""The documentation stays a manual: a short README, links that lead somewhere, and code comments
that give reasons rather than measurements (figures go stale where nobody re-measures them; they
live in docs/results/, each with its command, machine and date)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150

# `[text](target)`, the target up to the first space or closing parenthesis.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, hf:, ...

# A speedup figure (`1.27x`), a throughput (`23 tok/s`) or a CPU model: evidence that belongs in
# docs/results/, not in a comment. Case-sensitive, so flag names such as `amx_bf16` stay usable.
_MEASUREMENT = re.compile(
    r"\b\d+\.\d+x\b"
    r"|\b\d+(\.\d+)? ?tok(ens)?/s\b"
    r"|\b(Xeon|EPYC|Ryzen|Threadripper|Graviton|AMX|Sapphire Rapids|Emerald Rapids|Granite Rapids|Ice Lake|Cascade Lake)\b"
)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def broken_links(markdown: Path) -> list[str]:
    """The relative link targets in `markdown` that name no existing file or folder."""
    broken = []
    for target in _LINK.findall(markdown.read_text(encoding="utf-8")):
        if _EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (markdown.parent / path).exists():
            broken.append(target)
    return broken


def _is_docstring(previous: int | None) -> bool:
    """A string token is a docstring (or a bare string statement) when it opens a statement."""
    return previous in (None, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)


def measurement_citations(source: str) -> list[tuple[int, str]]:
    """`(line, text)` of each comment or docstring in `source` that cites a measurement or a CPU
    model; strings the code uses (messages, help text) are not looked at."""
    found = []
    previous = None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and _is_docstring(previous)):
            for offset, line in enumerate(token.string.splitlines()):
                if _MEASUREMENT.search(line):
                    found.append((token.start[0] + offset, line.strip()))
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type
    return found


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference text into docs/"


@pytest.mark.parametrize("markdown", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(markdown):
    assert broken_links(markdown) == []


def test_results_are_indexed():
    index = (ROOT / "docs" / "results" / "README.md").read_text(encoding="utf-8")
    for result in sorted((ROOT / "docs" / "results").glob("*.md")):
        if result.name != "README.md":
            assert f"({result.name})" in index, f"docs/results/README.md does not link {result.name}"


def test_comments_cite_no_measurement():
    offenders = []
    for package in ("hf_selfspec", "tuning"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, text in measurement_citations(path.read_text(encoding="utf-8")):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert offenders == [], "state the reason, and put the figure in docs/results/:\n" + "\n".join(offenders)


def test_a_planted_measurement_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""Fast: 1.27x plain greedy."""\n'
        "\n"
        "def f():\n"
        '    """Tuned on an Intel Xeon."""\n'
        '    message = "measured 1.27x"  # 23 tok/s there\n'
        '    return message, "a Xeon"\n',
        encoding="utf-8",
    )
    found = measurement_citations(planted.read_text(encoding="utf-8"))
    assert [line for line, _ in found] == [1, 4, 5]
    assert "23 tok/s" in found[2][1]


def test_reasons_and_flag_names_pass():
    source = '"""Wide verifications are cheap on CPUs with native bfloat16 (the amx_bf16 flag)."""\nx = 2  # twice as fast\n'
    assert measurement_citations(source) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("x", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a) [web](https://example.org) [self](#top) [gone](missing.md)\n", encoding="utf-8")
    assert broken_links(page) == ["missing.md"]
