"""The README and docs/ stay true to the tool: links and anchors resolve, every page is reachable from the README,
the README stays short and free of dated diary entries, its commands parse with the CLI's own parser and its make
targets exist; and the CLI's --version and per-verb examples work. CPU only, no training: seconds."""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from divergence import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 300

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`]+)`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def text(path: Path) -> str:
    return path.read_text()


def prose(md: str) -> str:
    """The page without its fenced code blocks (a link or a date in a code sample is not the page's own)."""
    return FENCE.sub("", md)


def code_blocks(md: str, langs=("bash", "sh", "shell", "console")) -> list:
    return [body for lang, body in FENCE.findall(md) if lang in langs]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    h = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def anchors(md: str) -> set:
    """Every heading's anchor, with GitHub's -1, -2 suffixes for repeats."""
    seen, out = {}, set()
    for h in HEADING.findall(prose(md)):
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def links(md: str) -> list:
    """Relative link targets of the page's prose (inline code removed: `[x](y)` there is not a link)."""
    return [t for t in LINK.findall(INLINE_CODE.sub("", prose(md))) if not re.match(r"[a-z]+:", t)]


# ------------------------------------------------------------------------------------------- links and pages


def broken_links(page: Path) -> list:
    bad = []
    for target in links(text(page)):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(text(dest))):
            bad.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page) == []


def test_a_broken_link_or_anchor_is_seen(tmp_path):
    """Break it once: a missing file and a missing heading are both reported."""
    page = tmp_path / "p.md"
    (tmp_path / "q.md").write_text("# Title\n\n## A `code` heading: here\n")
    page.write_text("[a](q.md#a-code-heading-here) [b](q.md#nowhere) [c](missing.md) [d](https://x.org/y)\n"
                    "```bash\n[e](also-missing.md)\n```\n")
    assert broken_links(page) == ["p.md: q.md#nowhere (no heading #nowhere in q.md)",
                                  "p.md: missing.md (no such file)"]


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(text(README)) if t.partition("#")[0]}
    assert DOCS and sorted(p.name for p in DOCS if p.resolve() not in linked) == []


def test_the_readme_is_short():
    n = len(text(README).splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): figures belong in docs/"


DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
DIARY = re.compile(r"\b(issues?|(?<!process )sessions?)\b", re.I)  # a Unix process session is the tool's


def dates_outside_links(md: str) -> list:
    return DATE.findall(re.sub(r"\]\([^)]*\)", "]()", md))


def test_the_readme_holds_no_dated_entries():
    """Figures with dates live in docs/, which the README links to: a date in the README is a diary entry."""
    assert dates_outside_links(text(README)) == []
    assert dates_outside_links("a [x](docs/p.md#run-2026-11-26) link; then 2026-11-26 in the text") == ["2026-11-26"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_pages_describe_the_tool_not_its_development(page):
    assert DIARY.findall(text(page)) == [], f"{page.name}: say what the tool is; history lives in git"


def test_named_files_exist():
    """Paths the pages name in code spans (`divergence/...`, `tests/...`, `benchmarks/...`, `recipes/...`) exist;
    placeholders (upper case, <...>, *) are not paths."""
    named = set()
    for page in PAGES:
        for span in INLINE_CODE.findall(text(page)):
            for m in re.findall(r"(?<![\w/.])((?:divergence|tests|benchmarks|recipes|docs)/[\w./-]*)", span):
                m = m.rstrip(".")
                if not re.search(r"[A-Z<>*]", m):
                    named.add(m)
    assert len(named) > 20
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


# ------------------------------------------------------------------------------------------- commands


def shell_lines(block: str) -> list:
    """Each command of a shell block: continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in block.splitlines():
        line = cur + line
        if line.rstrip().endswith("\\"):
            cur = line.rstrip()[:-1] + " "
            continue
        cur = ""
        words = shlex.split(line, comments=True)
        if words:
            out.append(words)
    return out


def divergence_args(words: list):
    """The arguments after `divergence` or `python -m divergence.cli`, or None for another command."""
    if words[:1] == ["divergence"]:
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1:words.index("-m") + 2] == ["divergence.cli"]:
        return words[words.index("-m") + 2:]
    return None


def parse_error(args: list):
    """None where the CLI's own parser accepts `args` (--version and --help included), else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.build_parser().parse_args(args)
    except SystemExit as e:
        if e.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


def readme_commands(md: str) -> list:
    """Every divergence command the page shows: in shell blocks and in inline code spans."""
    cmds = [w for block in code_blocks(md) for w in shell_lines(block)]
    for span in INLINE_CODE.findall(prose(md)):
        span = " ".join(span.split())
        if span.startswith(("divergence ", "python -m divergence.cli ")):
            cmds.append(shlex.split(span))
    return [(" ".join(w), a) for w in cmds if (a := divergence_args(w)) is not None]


def test_the_readme_commands_name_real_verbs_and_flags():
    cmds = readme_commands(text(README))
    assert len(cmds) >= 8  # the pattern still finds them
    assert [(c, e) for c, a in cmds if (e := parse_error(a))] == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_the_docs_commands_parse_too(page):
    assert [(c, e) for c, a in readme_commands(text(page)) if (e := parse_error(a))] == []


def test_a_wrong_flag_or_verb_in_a_command_is_seen():
    md = ("```bash\ndivergence ab --kernel fused_embed_rmsnorm --candiate k.py   # typo\n"
          "python -m divergence.cli soak x.yaml \\\n   --no-wandb\ndivergence abb\nls -l\n```\n"
          "and `divergence probe --seed seven` inline")
    cmds = readme_commands(md)
    assert [c for c, _ in cmds] == ["divergence ab --kernel fused_embed_rmsnorm --candiate k.py",
                                    "python -m divergence.cli soak x.yaml --no-wandb", "divergence abb",
                                    "divergence probe --seed seven"]
    assert [bool(parse_error(a)) for _, a in cmds] == [True, False, True, True]


def make_targets() -> set:
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


def make_uses(md: str) -> set:
    """`make X` in the page's shell blocks and inline code."""
    spans = [w for block in code_blocks(md) for w in shell_lines(block)]
    spans += [shlex.split(s) for s in INLINE_CODE.findall(prose(md)) if s.startswith("make ")]
    return {next((x for x in w[1:] if "=" not in x and not x.startswith("-")), "") for w in spans if w[:1] == ["make"]}


def test_the_readme_make_targets_exist():
    used = make_uses(text(README))
    assert {"setup", "test", "ab"} <= used
    assert sorted(used - make_targets()) == []
    assert make_uses("```bash\nmake nosuch ARGS=1\n```") - make_targets() == {"nosuch"}


# ------------------------------------------------------------------------------------------- the CLI itself


def verbs(parser, prefix=()) -> list:
    """(name, parser) of every subcommand, nested ones (`data stats`) included."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((" ".join(prefix + (name,)), sub))
                out.extend(verbs(sub, prefix + (name,)))
    return out


def test_every_verb_help_ends_with_examples_that_parse():
    found = verbs(cli.build_parser())
    assert {"ab", "probe", "soak", "report", "train", "data", "data stats"} <= {n for n, _ in found}
    for name, sub in [("divergence", cli.build_parser()), *found]:
        tail = sub.format_help().split("Examples:")
        assert len(tail) == 2, f"{name} --help has no Examples"
        lines = [ln.strip() for ln in tail[1].splitlines() if ln.strip()]
        assert len(lines) >= 2, name
        for ln in lines:
            words = shlex.split(ln, comments=True)
            assert words[0] == "divergence" and parse_error(words[1:]) is None, (name, ln)
            if name != "divergence":
                assert " ".join(words[1:]).startswith(name), (name, ln)


def test_version_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "divergence.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"divergence {cli.version()}"
    import divergence

    assert cli.version() == divergence.__version__


def test_ab_without_text_fails_before_the_candidate_the_probe_or_the_results_folder(tmp_path, capsys):
    """No text is one line (exit 2) before anything expensive runs: no candidate loaded, no probe, no folder."""
    out, broken = tmp_path / "r", tmp_path / "broken.py"
    broken.write_text("def run(:\n")  # a candidate that fails only once loaded
    code = cli.main(["ab", "--kernel", "fused_embed_rmsnorm", "--candidate", str(broken),
                     "--recipe", "tiny", "--set", f"data.source={tmp_path / 'no-text.txt'}", "--set",
                     "ab.probe=true", "--no-wandb", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: data.source") and "no-text.txt" in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("argv,said", [
    (["ab", "--kernel", "fused_embed_rmsnorm", "--candidate", "{tmp}/typo.py"], "candidate file not found: "),
    (["probe", "--candidate", "{tmp}/sol/solution.json"], "candidate file not found: "),
    (["ab", "--resume", "{tmp}"], "not a results folder"),
    (["probe", "--kernel", "fused_embed_rmsnorm", "--definition", "{tmp}/definition.json"], "--definition "),
])
def test_a_mistyped_path_fails_before_anything_starts(argv, said, tmp_path, monkeypatch, capsys):
    """cli.check_paths: before the fork server (on a GPU machine), torch's import or the candidate's loader."""
    import divergence.ab.runner as runner

    started = []
    monkeypatch.setattr(runner, "start_server_first", lambda: started.append(1) or False)
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and err.count("\n") == 1, err
    assert started == [] and not (tmp_path / "results").exists()
