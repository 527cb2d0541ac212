"""`divergence report`: the page of a real tiny A/B run, every image it references, and the words it uses.

One real `divergence ab` (tiny recipe, SGD only, wandb offline, about a minute on one CPU) per test session, shared
with tests/test_wandb.py through `tiny_ab`.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
from filelock import FileLock
from markupsafe import escape

from divergence.cli import main
from divergence.report import words, write_report
from divergence.zoo import DEMO, ZOO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_ab(tmp_path_factory) -> Path:
    """Results folder of a real `divergence ab --recipe tiny --optimizers sgd`, made once per session: in this
    process (a fresh interpreter added 5-20 s of imports and showed nothing more), once for all pytest-xdist
    workers (the first to get the lock makes it in their common folder)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / "ab-tiny-sgd"
    with FileLock(f"{out}.lock"):
        if not (out / "verdict.json").exists():
            shutil.rmtree(out, ignore_errors=True)  # a failed attempt's
            _run_tiny_ab(out)
    assert json.loads((out / "verdict.json").read_text())["verdict"] != "PASS"
    return out


def _run_tiny_ab(out: Path):
    said = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        for k in [k for k in os.environ if k.startswith("WANDB_")]:
            mp.delenv(k)
        mp.setenv("WANDB_MODE", "offline")  # never the network from a test
        mp.setenv("WANDB_PROJECT", "divergence-tests")
        code = main(["ab", "--kernel", "fused_embed_rmsnorm", "--recipe", "tiny", "--optimizers", "sgd",
                     "--out", str(out)])
    if out.exists():
        (out / "ab.log").write_text(said.getvalue())
    # The slot's demo candidate is the zoo's bf16-accumulating kernel: a finding, exit 1 (0 would be a missed
    # bug, 2 a harness error; either makes every page test below read the wrong run).
    assert ZOO[DEMO["fused_embed_rmsnorm"]].verdict == "bad"
    assert code == 1, f"divergence ab exited {code}:\n{said.getvalue()[-6000:]}"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return tiny_ab(tmp_path_factory)


def _images(page: Path) -> list:
    return re.findall(r'<img[^>]+src="([^"]+)"', page.read_text())


def test_ab_writes_the_report_and_every_image_it_references(results):
    page = results / "report.html"
    assert page.is_file() and page.stat().st_size > 2000
    log = (results / "ab.log").read_text()
    assert f"report: {page}" in log  # `ab` ran it, and said where
    srcs = _images(page)
    # tiny checks the candidate in lockstep every step, so all four figures apply
    assert sorted(Path(s).stem for s in srcs) == ["distance", "drift", "lockstep", "loss"]
    for s in srcs:
        f = results / s
        assert f.is_file() and f.stat().st_size > 10_000, s
        assert f.read_bytes()[:8] == PNG_MAGIC, s


def test_page_opens_with_the_verdict_in_words(results):
    v = json.loads((results / "verdict.json").read_text())
    text = (results / "report.html").read_text()
    body = text[text.index("<body>"):]
    first_fig = body.index("<img")
    assert f'banner {v["verdict"]}' in body[:first_fig]  # the verdict comes before any figure
    for opt, ov in v["optimizers"].items():
        sentence = words.optimizer_sentence(ov, v["rule"])
        assert str(escape(sentence)) in body[:first_fig]
        if ov["verdict"] == "DIVERGED":
            assert words.metric_words(ov["metric"]) in sentence
            assert f"at step {ov['first_step']}" in sentence
    assert v["candidate"]["sha256"][:16] in body


def test_report_command_rewrites_the_page(results, tmp_path, capsys):
    folder = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))
    (folder / "report.html").unlink()
    shutil.rmtree(folder / "plots")
    assert main(["report", str(folder)]) == 0
    assert f"report: {folder / 'report.html'}" in capsys.readouterr().out
    srcs = _images(folder / "report.html")
    assert sorted(Path(s).stem for s in srcs) == ["distance", "drift", "lockstep", "loss"]
    for s in srcs:
        assert (folder / s).stat().st_size > 10_000


def test_report_of_a_run_whose_lockstep_median_is_infinite(results, tmp_path, capsys):
    """verdict.json keeps a candidate's infinite median error ratio as "inf" (strict JSON); the report reads it
    back as a number and says it (it crashed on the string: seen on the cell of a NaN-making kernel, H200)."""
    from divergence.train.metrics import write_json

    folder = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))
    v = json.loads((folder / "verdict.json").read_text())
    v["optimizers"]["sgd"]["lockstep"]["record"]["median_ratio"] = float("inf")
    write_json(folder / "verdict.json", v)
    assert '"median_ratio": "inf"' in (folder / "verdict.json").read_text()
    assert main(["report", str(folder)]) == 0, capsys.readouterr().err
    assert "median error not finite, the reference&#39;s finite" in (folder / "report.html").read_text()


def test_report_of_a_folder_that_is_not_a_results_folder(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no plan.json" in capsys.readouterr().err
    (tmp_path / "plan.json").write_text("{}")
    assert main(["report", str(tmp_path)]) == 2
    assert "--resume" in capsys.readouterr().err  # planned but unfinished: say how to finish it


def _blank_figures(monkeypatch, broken=()):
    """Replace the figures by blank ones (the real ones are drawn by the tests above), some by failing ones."""
    import matplotlib.pyplot as plt

    from divergence.report import plots

    def blank(res, path):
        fig = plt.figure(figsize=(1, 1))
        fig.savefig(path)
        plt.close(fig)

    def fail(res, path):
        raise ValueError("no luck")

    for name, entry in list(plots.PLOTS.items()):
        monkeypatch.setitem(plots.PLOTS, name, ((fail if name in broken else blank),) + entry[1:])


def test_a_figure_that_fails_leaves_the_page_and_the_others(results, tmp_path, monkeypatch):
    folder = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))
    _blank_figures(monkeypatch, broken=("drift",))
    page = write_report(folder)
    text = page.read_text()
    assert "could not be drawn: ValueError: no luck" in text
    assert sorted(Path(s).stem for s in _images(page)) == ["distance", "lockstep", "loss"]
    assert not (folder / "plots" / "drift.png").exists()  # no stale figure from the earlier report


def test_a_verdict_the_page_cannot_read_still_gives_a_page(results, tmp_path, monkeypatch, capsys):
    """`ab` writes the report after the verdict: a verdict.json of another schema must not make it fail."""
    folder = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))
    v = json.loads((folder / "verdict.json").read_text())
    v["optimizers"]["sgd"]["metrics"] = [{"name": "loss"}]  # no "metric", "flagged", ...
    (folder / "verdict.json").write_text(json.dumps(v))
    _blank_figures(monkeypatch)
    text = write_report(folder).read_text()
    assert "could not be rendered in full (KeyError" in text
    assert str(escape(f'"verdict": "{v["verdict"]}"')) in text  # the raw verdict, for a person to read
    assert sorted(Path(s).stem for s in _images(folder / "report.html")) == ["distance", "drift", "lockstep", "loss"]
    assert capsys.readouterr().out.startswith("report: the page could not be rendered in full")


def test_markup_in_a_candidate_name_is_text_on_the_page(results, tmp_path, monkeypatch):
    """A candidate's name, a summary and an arm's error come from the user's files: the template escapes them."""
    folder = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))
    evil = '<script>alert("x")</script>'
    v = json.loads((folder / "verdict.json").read_text())
    v["candidate"]["name"] = evil
    v["summary"] = f"wrong {evil}"
    (folder / "verdict.json").write_text(json.dumps(v))
    info = json.loads((folder / "sgd" / "candidate" / "arm.json").read_text())
    (folder / "sgd" / "candidate" / "arm.json").write_text(json.dumps({**info, "error": evil}))
    _blank_figures(monkeypatch)
    text = write_report(folder).read_text()
    assert "could not be rendered" not in text
    assert "<script" not in text.lower()
    assert text.count("&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;") >= 5  # title, h1, sub, banner, arms table


def test_report_of_a_candidate_that_stopped_with_nan(results, tmp_path):
    """A NaN candidate leaves short metrics, no snapshots and no distances: every figure still draws, no warning."""
    folder = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))
    cand = folder / "sgd" / "candidate"
    info = json.loads((cand / "arm.json").read_text())
    info.update(status="NAN", stop_step=2, stop_where="output of the fused_embed_rmsnorm candidate")
    (cand / "arm.json").write_text(json.dumps(info))
    rows = (cand / "metrics.jsonl").read_text().splitlines()[:3]
    rows[-1] = rows[-1].replace('"loss": ', '"loss": "nan", "was": ', 1)
    (cand / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    shutil.rmtree(cand / "snapshots")
    v = json.loads((folder / "verdict.json").read_text())
    v["verdict"] = "NAN"
    v["optimizers"]["sgd"] = {"verdict": "NAN", "detail": "step 2: non-finite output", "step": 2,
                              "where": "output of the fused_embed_rmsnorm candidate",
                              "lockstep": v["optimizers"]["sgd"].get("lockstep")}
    (folder / "verdict.json").write_text(json.dumps(v))
    d = json.loads((folder / "drift.json").read_text())
    d["sgd"].pop("row_drift_candidate", None)
    (folder / "drift.json").write_text(json.dumps(d))

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # NaN reaching matplotlib's transforms warns
        page = write_report(folder)
    text = page.read_text()
    assert "could not be drawn" not in text
    assert "No distances to draw: the candidate finished under no optimizer (sgd: NAN)" in text
    assert "banner NAN" in text and "stopped at step 2" in text
    assert sorted(Path(s).stem for s in _images(page)) == ["drift", "lockstep", "loss"]


def test_effect_sizes_read_at_any_magnitude():
    assert words.times(2.6989) == "2.7x"
    assert words.times(374.58) == "375x"
    assert words.times(2.7e27) == "2.7e27x"
    assert words.times(float("inf")) == "inf"


def test_report_reuses_the_distances_the_verdict_computed(results, monkeypatch, tmp_path):
    """In one run the verdict's distances serve the report and wandb, through the run's ArmFiles: none is computed
    twice (each pair reads the arms' snapshots and evaluations, seconds at GPU-recipe sizes); a fresh ArmFiles
    (another run) computes them afresh. On a copy: the shared tiny A/B stays read-only for the other worker."""
    from divergence.detect import distances as compare

    results = shutil.copytree(results, tmp_path / "r", ignore=shutil.ignore_patterns("wandb"))

    calls = []
    real = compare.scalar_distances
    monkeypatch.setattr(compare, "scalar_distances", lambda *a: calls.append(a) or real(*a))
    files = compare.ArmFiles()
    write_report(results, files)
    first = len(calls)
    assert first > 0  # the report did need them
    write_report(results, files)  # a fresh read of the folder with the same run's files, as wandb's after the page
    assert len(calls) == first
    write_report(results)
    assert len(calls) == 2 * first


def test_the_page_and_wandb_show_every_signal(results):
    """The four signals of verdict.json, each with its word and reason, on the page."""
    v = json.loads((results / "verdict.json").read_text())
    text = (results / "report.html").read_text()
    assert set(v["signals"]) == {"ab", "lockstep", "probe", "tripwire"}
    for name, sig in v["signals"].items():
        # as the page's autoescaping template writes them (markupsafe, jinja2's own escaper)
        assert str(escape(words.SIGNAL_NAMES[name])) in text
        assert str(escape(sig["reason"])) in text, name
    assert f"Exit code {v['exit_code']}" in text


def test_the_flag_line_is_drawn_and_worded_at_the_margin_the_verdict_used(results, tmp_path):
    """Where the leave-one-out check widened an optimizer's margin, the plot's flag line, the metric table's limit
    and the words are at the widened margin: at the rule's 3x the plot showed a candidate over the line and not
    flagged, and the page said training "stayed within 3x" (h200-story, SGD lr 0.5, 2026-11-25: margin 19.1)."""
    from divergence.detect.verdict import floor_for, margin_used
    from divergence.report.html import _metric_tables
    from divergence.report.results import load_results

    rule = {"margin": 3.0}
    assert margin_used({"calibration": {"margin": 19.1, "widened": True}}, rule) == 19.1
    assert margin_used({"calibration": {"margin": 3.0}}, rule) == 3.0 and margin_used({}, rule) == 3.0
    out = tmp_path / "r"
    shutil.copytree(results, out, symlinks=True)
    v = json.loads((out / "verdict.json").read_text())
    opt = next(iter(v["optimizers"]))
    v["optimizers"][opt].setdefault("calibration", {}).update(margin=19.1, widened=True, note="envelope too thin")
    v["optimizers"][opt]["verdict"] = "WRONG"
    (out / "verdict.json").write_text(json.dumps(v))
    res = load_results(out)
    k, m = next((k, m) for k, m in enumerate(v["optimizers"][opt]["metrics"]) if m["final_envelope"] > 0)
    row = _metric_tables(res)[0]["rows"][k]
    assert float(row["limit"]) == pytest.approx(19.1 * m["final_envelope"] + floor_for(m["metric"]), rel=1e-2)
    assert "Training stayed within 19.1x" in words.optimizer_sentence(v["optimizers"][opt], v["rule"])
