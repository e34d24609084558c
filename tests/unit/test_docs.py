"""The documentation stays a manual: a short README, links that lead somewhere, and a manual and code
comments that give reasons rather than measurements (figures go stale where nobody re-measures
them; they live in docs/results/, each with its command, machine and date, one short line each in
docs/results/README.md)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150
INDEX_LINE_MAX = 200  # characters in a line of docs/results/README.md that links a results file

# The README's one section that may show measured figures: a single table, with its machine, date
# and command. Everywhere else in the manual a figure would be a claim nobody re-checks.
MEASURED_HEADING = "## Measured"

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


# What dates a text or records a speedup: `2026-11-30`, `1.42x`. The baseline against itself,
# `1.00x`, is a column's format (bench.md shows its terminal table), not a measurement.
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
_RATIO = re.compile(r"\b(?!1\.00x\b)\d+\.\d+x\b")
# A link's target, dropped before looking for dates: results files are named by the date of their run.
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_TABLE_RULE = re.compile(r"^\s*\|\s*:?-{3,}")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def manual_files() -> list[Path]:
    """The manual: the README and the pages of docs/, not the results under docs/results/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def dates_and_ratios(text: str, measured_section: bool = False) -> list[tuple[int, str]]:
    """`(line, text)` of each line of `text` that carries a date or a measured ratio, link targets
    aside. With `measured_section`, the lines under a `## Measured` heading (up to the next `## `
    heading) are the README's one place for figures and are not looked at."""
    found = []
    inside = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("## "):
            inside = measured_section and line.strip() == MEASURED_HEADING
        if inside:
            continue
        prose = _LINK_TARGET.sub("]()", line)
        if _DATE.search(prose) or _RATIO.search(prose):
            found.append((number, line.strip()))
    return found


def measured_sections(text: str) -> list[list[str]]:
    """The lines of each `## Measured` section of `text`, heading excluded."""
    sections: list[list[str]] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("## "):
            inside = line.strip() == MEASURED_HEADING
            if inside:
                sections.append([])
            continue
        if inside:
            sections[-1].append(line)
    return sections


def long_index_lines(index: str, limit: int = INDEX_LINE_MAX) -> list[str]:
    """The lines of a results index that link a file and run past `limit` characters."""
    return [
        line
        for line in index.splitlines()
        if len(line) > limit and any(not _EXTERNAL.match(t) and not t.startswith("#") for t in _LINK.findall(line))
    ]


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


@pytest.mark.parametrize("markdown", manual_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_manual_carries_no_date_or_measured_ratio(markdown):
    is_readme = markdown == ROOT / "README.md"
    found = dates_and_ratios(markdown.read_text(encoding="utf-8"), measured_section=is_readme)
    where = [f"{markdown.relative_to(ROOT)}:{line}: {text}" for line, text in found]
    assert where == [], "describe it here; the figure or the dated story goes to docs/results/:\n" + "\n".join(where)


def test_readme_measures_in_one_section_with_one_table():
    sections = measured_sections((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(sections) == 1, f"README.md has {len(sections)} '{MEASURED_HEADING}' sections; keep one"
    tables = sum(1 for line in sections[0] if _TABLE_RULE.match(line))
    assert tables == 1, f"README.md's '{MEASURED_HEADING}' holds {tables} tables; keep one, link the rest"


def test_a_planted_date_or_ratio_is_found():
    page = (
        "# Page\n"  # 1
        "It ran 1.42x faster.\n"  # 2
        "Measured on 2026-11-30.\n"  # 3
        "See [the run](results/2026-11-30-epyc.md) and the baseline's 1.00x.\n"  # 4: neither counts
        "Version 2.13.0, a 2x rule of thumb, `max_draft_tokens = 12`.\n"  # 5: none of these either
        "## Measured\n"  # 6
        "| a | b |\n"  # 7
        "|---|---|\n"  # 8
        "| 1.70x | 2026-11-30 |\n"  # 9: found unless this is the README's section
        "## The manual\n"  # 10
        "[1.10x](x.md) on the same kernels\n"  # 11: link text is prose
    )
    assert [line for line, _ in dates_and_ratios(page)] == [2, 3, 9, 11]
    assert [line for line, _ in dates_and_ratios(page, measured_section=True)] == [2, 3, 11]
    assert measured_sections(page) == [["| a | b |", "|---|---|", "| 1.70x | 2026-11-30 |"]]


def test_results_index_has_one_short_line_per_file():
    index = (ROOT / "docs" / "results" / "README.md").read_text(encoding="utf-8")
    assert long_index_lines(index) == [], f"keep each indexed file to one line of at most {INDEX_LINE_MAX} characters"
    for result in sorted((ROOT / "docs" / "results").glob("*.md")):
        if result.name != "README.md":
            lines = [line for line in index.splitlines() if f"({result.name})" in line]
            assert len(lines) == 1, f"docs/results/README.md links {result.name} on {len(lines)} lines; give it one"


def test_a_planted_long_index_line_is_found():
    short = "| 2026-11-30 | AMD EPYC (avx512_bf16) | [the run](2026-11-30-x.md) |"
    long = "| 2026-11-30 | AMD EPYC (avx512_bf16) | [" + "a long story " * 20 + "](2026-11-30-y.md) |"
    prose = "An introduction without a link, " * 10
    assert long_index_lines("\n".join([short, long, prose])) == [long]


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
