"""The docs against the code they describe.

- docs/configuration.md lists exactly the config.pbtxt parameters of `EngineConfig` and
  `ServingOptions` (backend/config.py), each with its default;
- every relative link of README.md and docs/ leads to a file that exists (and, into a markdown
  file, to a heading it has);
- README.md stays a page a newcomer reads: about 200 lines, its prose wrapped;
- docs/results.md is what `python -m client.bench.table --write docs/results.md` makes from the
  reports under bench/results/.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from backend import config
from backend.config import EngineConfig, ServingOptions
from backend.paths import REPO_ROOT
from client.bench import table

ROOT = Path(REPO_ROOT)
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
# A table cell boundary: a `|` not escaped as `\|`.
CELL = re.compile(r"(?<!\\)\|")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def documented_parameters(text: str) -> dict[str, str]:
    """{parameter: its default cell} from every markdown table whose header has a `parameter`
    and a `default` column, the parameter written in backticks."""
    found: dict[str, str] = {}
    columns: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        cells = [cell.strip() for cell in CELL.split(line.strip()[1:-1])]
        if columns is None:
            columns = [cell.lower() for cell in cells]
            continue
        if set(cells) <= {"---", ":---", "---:", ":---:"} or "parameter" not in columns or "default" not in columns:
            continue
        name = re.fullmatch(r"`([^`]+)`", cells[columns.index("parameter")])
        assert name, f"a parameter row must name its parameter in backticks: {line}"
        assert name.group(1) not in found, f"{name.group(1)} is listed twice"
        found[name.group(1)] = cells[columns.index("default")]
    return found


def code_parameters() -> dict[str, dataclasses.Field]:
    """config.pbtxt name -> dataclass field, for every parameter the backend reads."""
    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    serving = {f.name: f for f in dataclasses.fields(ServingOptions)}
    assert set(ServingOptions.PARAMETERS.values()) == set(serving), "a ServingOptions field has no config.pbtxt name"
    return {**engine, **{name: serving[field] for name, field in ServingOptions.PARAMETERS.items()}}


MISSING = dataclasses.MISSING


def documented_default(name: str, field: dataclasses.Field, cell: str):
    """The value a default cell stands for, read as config.pbtxt's value is (`config._parse`):
    the value in backticks at the start of the cell; `empty`: the empty string, or None for an
    optional field; anything else (e.g. "the version folder"): no default of the dataclass's own."""
    value = re.match(r"`([^`]*)`", cell)
    if value:
        return config._parse(name, field.type, value.group(1))
    if cell.split(" ")[0].rstrip(",;") == "empty":
        return "" if field.type == "str" else None
    return MISSING


def code_default(field: dataclasses.Field):
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return MISSING


def configuration_mismatches(text: str) -> list[str]:
    documented = documented_parameters(text)
    parameters = code_parameters()
    problems = [f"missing: {name}" for name in parameters if name not in documented]
    problems += [f"not a parameter: {name}" for name in documented if name not in parameters]
    for name, field in parameters.items():
        if name not in documented:
            continue
        real = code_default(field)
        try:
            said = documented_default(name, field, documented[name])
        except ValueError as exc:  # not a value the parameter takes
            problems.append(f"default of {name}: {exc}")
            continue
        if said != real:
            problems.append(f"default of {name}: documented {documented[name]!r}, the code's {real!r}")
    return problems


def test_configuration_lists_every_parameter_with_its_default():
    assert configuration_mismatches(CONFIGURATION.read_text()) == []


def test_the_configuration_check_finds_a_missing_an_extra_and_a_wrong_parameter():
    text = CONFIGURATION.read_text()
    assert "| `block_size` | `16` |" in text and "| `stream_interval` | `1` |" in text
    missing = "\n".join(line for line in text.splitlines() if not line.startswith("| `max_loras` |"))
    assert configuration_mismatches(missing) == ["missing: max_loras"]
    extra = text.replace("| `seed` | `0` |", "| `sede` | `0` | a typo |\n| `seed` | `0` |")
    assert configuration_mismatches(extra) == ["not a parameter: sede"]
    wrong = text.replace("| `block_size` | `16` |", "| `block_size` | `32` |")
    assert configuration_mismatches(wrong) == ["default of block_size: documented '`32`', the code's 16"]
    serving = text.replace("| `stream_interval` | `1` |", "| `stream_interval` | `4` |")
    assert configuration_mismatches(serving) == ["default of stream_interval: documented '`4`', the code's 1"]
    empty = text.replace("| `kv_events_topic` | empty |", "| `kv_events_topic` | `inflight` |")
    assert configuration_mismatches(empty) == ["default of kv_events_topic: documented '`inflight`', the code's ''"]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered."""
    anchors: set[str] = set()
    for line in without_code_blocks(path.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            candidate, n = anchor, 0
            while candidate in anchors:
                n += 1
                candidate = f"{anchor}-{n}"
            anchors.add(candidate)
    return anchors


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(without_code_blocks(path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
            broken.append(f"{target}: no such heading")
    return broken


def test_every_relative_link_resolves():
    broken = {str(path.relative_to(ROOT)): links for path in markdown_files() if (links := broken_links(path))}
    assert broken == {}


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "b.md").write_text("# Title\n\n## A `code` heading: yes\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#a-code-heading-yes) [file](c.md) [heading](b.md#nope) [web](https://x.org/y)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["c.md: no such file", "b.md#nope: no such heading"]


def test_readme_stays_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    # Table rows cannot wrap; prose can.
    prose = without_code_blocks(text).splitlines()
    assert [line for line in prose if len(line) > 110 and not line.startswith("|")] == []


def test_results_page_is_generated_from_every_committed_report():
    # Regenerate with `python -m client.bench.table --write docs/results.md`.
    assert (DOCS / "results.md").read_text() == table.results_document(table.committed_reports())
