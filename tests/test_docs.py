"""The docs hold: every `docs/<file>.md [section N]` that code, rules, profiles or build files cite exists; the
README is at most 250 lines and every command in its code blocks runs (a dry run where it would train); the links
and RESULTS.md sections that README.md and docs/ cite exist.

    .venv/bin/pytest -q tests/test_docs.py
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITING = ["src", "rules", "profiles", "benchmarks", "tests", ".ci", "Makefile", "Snakefile", "pyproject.toml",
          "matrix.yaml"]  # fmt: skip
CITE = re.compile(r"docs/([\w.-]+\.md)(?:,? section (\d+))?")


def citations():
    for name in CITING:
        top = ROOT / name
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()] if top.is_dir() else []
        for path in files:
            if "__pycache__" in path.parts or path.suffix in (".pyc", ".parquet", ".gz"):
                continue
            text = path.read_text(errors="ignore")
            for m in CITE.finditer(text):
                yield path.relative_to(ROOT).as_posix(), m[1], m[2]


def test_cited_docs_and_sections_exist():
    found = list(citations())
    assert len(found) >= 10  # the comments this test exists for
    missing = []
    for where, doc, section in found:
        path = ROOT / "docs" / doc
        if not path.is_file():
            missing.append(f"{where}: docs/{doc} does not exist")
        elif section and not re.search(rf"^## {section}\. ", path.read_text(), re.M):
            missing.append(f"{where}: docs/{doc} has no section {section}")
    assert not missing, "\n".join(missing)


# ---------------------------------------------------------------- the README
#
# Every shell command in the README's ```sh blocks runs here: for real where it is cheap and trains nothing
# (`marlflow matrix`, `marlflow plan`), as a dry run where it would train (`snakemake -n`, `make -n`), and as
# `--help` plus "every option it uses exists" where it needs a trained run or would start a server. A command this
# file has no rule for fails the test: add a rule, so that no README command goes unchecked.

README = ROOT / "README.md"
MAX_README_LINES = 250
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
BIN = Path(sys.executable).parent  # the venv's bin: marlflow, snakemake, tensorboard
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
}


def readme_blocks(lang: str) -> list[str]:
    return [body for fence_lang, body in FENCE.findall(README.read_text()) if fence_lang == lang]


def readme_commands() -> list[str]:
    """The commands of the README's ```sh blocks, one per line, without the trailing `# comment`."""
    out = []
    for body in readme_blocks("sh"):
        for line in body.replace("\\\n", " ").splitlines():
            cmd = re.sub(r"\s+#\s.*$", "", line).strip()
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
    return out


def sh(argv: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def ok(argv: list[str], timeout: int = 120) -> str:
    """Run argv from the repository root; fail with its output unless it exits 0; return stdout + stderr."""
    out = sh(argv, timeout)
    assert out.returncode == 0, (
        f"`{shlex.join(argv)}` exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out.stdout + out.stderr


def options_in_help(argv: list[str], help_argv: list[str]) -> None:
    """Every --option the README passes is one the command's own --help lists."""
    text = ok(help_argv)
    used = [a.split("=")[0] for a in argv if a.startswith("--")]
    missing = [o for o in used if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]
    assert not missing, f"`{shlex.join(argv)}`: {missing} not in `{shlex.join(help_argv)}`"


def default_run_ids() -> set[str]:
    """The run ids of matrix.yaml's default preset: the runs `make run` trains (toy2's, toy world v2)."""
    return {r["run_id"] for r in json.loads(ok([str(BIN / "marlflow"), "matrix", "--json"]))}


def check_snakemake(argv: list[str]) -> None:
    """A dry run of the same command (`--nolock`: a dry run must not contend with a matrix running here)."""
    if "--unlock" in argv:  # a real unlock would release a running matrix's lock; its flag and profile exist
        assert (ROOT / argv[argv.index("--profile") + 1]).is_dir()
        options_in_help(argv, [str(BIN / "snakemake"), "--help"])
        return
    out = ok([str(BIN / "snakemake"), *argv[1:], "-n", "--nolock"], timeout=300)
    assert "This was a dry-run" in out, out[-2000:]


def check_marlflow(argv: list[str]) -> None:
    verb = argv[1]
    if verb in ("matrix", "plan"):  # cheap and trains nothing: for real
        out = ok([str(BIN / "marlflow"), *argv[1:]])
        assert ("fit" in out) if verb == "plan" else ("run_id" in out), out[-2000:]
    elif verb == "run":
        check_snakemake(["snakemake", "--profile", "profiles/local", *argv[2:]])
    elif verb in ("eval", "chat", "train"):  # needs a trained run: the options exist, `make run` trains it
        options_in_help(argv, [str(BIN / "marlflow"), verb, "--help"])
        runs = [a for a in argv if a.startswith("results/runs/")]
        for run in runs:
            assert Path(run).name in default_run_ids(), (
                f"`{shlex.join(argv)}`: {run} is not a run of the default preset (what `make run` trains)"
            )
    else:
        raise AssertionError(f"no rule in tests/test_docs.py for `marlflow {verb}`: add one")


def check_make(argv: list[str]) -> None:
    """`make -n TARGET` prints its recipe; `make run`'s Snakemake command is then dry-run itself."""
    target = argv[1]
    out = ok(["make", "-n", target])
    if target == "run":
        line = next(x for x in out.splitlines() if "snakemake" in x and "--profile profiles/local" in x)
        check_snakemake(shlex.split(line))
    elif target == "test":
        assert "pytest" in out, out


def check_pip(argv: list[str]) -> None:
    """Installs are not run; their constraint file exists and every extra they name is declared."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert (ROOT / argv[argv.index("-c") + 1]).is_file()
    for spec in [a for a in argv if a.startswith(".[")]:
        unknown = [e for e in spec[2:-1].split(",") if e not in extras]
        assert not unknown, f"`{shlex.join(argv)}`: extras {unknown} are not in pyproject.toml"


def check_command(cmd: str) -> None:
    argv = shlex.split(cmd)
    if argv[0] == "make":
        check_make(argv)
    elif argv[0] == "snakemake":
        check_snakemake(argv)
    elif argv[0] == "marlflow":
        check_marlflow(argv)
    elif argv[0] == "pip":
        check_pip(argv)
    elif argv[0] == "tensorboard":  # would start a server
        options_in_help(argv, [str(BIN / "tensorboard"), "--helpfull"])
    else:
        raise AssertionError(f"no rule in tests/test_docs.py for README command `{cmd}`: add one")


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines; keep it <= {MAX_README_LINES} (details go to docs/)"
    )


def test_readme_has_commands_and_only_known_blocks():
    langs = {lang for lang, _ in FENCE.findall(README.read_text())}
    assert langs <= {"sh", "text", "python"}, langs  # an unlabelled or other block would escape these checks
    cmds = readme_commands()
    assert cmds[:2] == ["make run", "make test"], cmds[:2]  # the quickstart's two commands come first
    assert len(cmds) >= 8, cmds


@pytest.mark.slow
@pytest.mark.parametrize("cmd", readme_commands())
def test_readme_command_runs(cmd):
    check_command(cmd)


def test_readme_python_blocks_compile():
    blocks = readme_blocks("python")
    assert blocks
    for body in blocks:
        compile(body, "README.md", "exec")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}


def test_links_in_readme_and_docs_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists, and its #anchor a heading."""
    bad = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                bad.append(f"{doc.name}: {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{doc.name}: {target}: no heading with that anchor in {path.name}")
    assert not bad, "\n".join(bad)


def test_results_sections_quoted_in_docs_exist():
    """`benchmarks/RESULTS.md`, "Section" in README.md or docs/ names a heading of RESULTS.md."""
    headings = [
        h.lower() for h in re.findall(r"^#+ (.*)$", (ROOT / "benchmarks/RESULTS.md").read_text(), re.M)
    ]
    quote = re.compile(r"RESULTS\.md`?,? \(?\"([^\"]+)\"")
    found, bad = 0, []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for name in quote.findall(doc.read_text()):
            found += 1
            if not any(name.lower() in h for h in headings):
                bad.append(f'{doc.name}: RESULTS.md "{name}" is no section of benchmarks/RESULTS.md')
    assert found >= 3 and not bad, "\n".join(bad)


def test_readme_names_the_shipped_toy_weights():
    """The README's expectations name the weights they were measured with: the default preset's model (toy2)."""
    from marlflow.models.toybuild2 import SHIPPED

    shipped = json.loads((SHIPPED["toy2"] / "warmstart.json").read_text())["weights_sha256"]
    assert f"`{shipped[:8]}…`" in README.read_text()
    prov = json.loads((ROOT / "results/evidence/toy2/provenance.json").read_text())
    assert set(prov["weights_sha256"].values()) == {shipped}  # the evidence was trained on the shipped model


def test_readme_expectations_come_from_the_committed_toy_evidence():
    """The README's bullets on the default preset (`results/evidence/toy2`, on [A]) and on `toy_agents` recompute
    from the committed data: bases and how many are in the band, held-out peaks per task, gains, the SP - IP code
    rows, the slot amplification, so the README cannot drift from the data."""
    import pandas as pd

    from marlflow.core.definitions import TOY_BASE_BAND

    ev = ROOT / "results/evidence"
    prov = json.loads((ev / "toy2/provenance.json").read_text())
    assert {f for e in prov["environments"] for f in e["cpu_flags"]} >= {"amx_bf16", "amx_tile"}  # [A]
    s = pd.read_parquet(ev / "toy2/summary.parquet")
    text = " ".join(README.read_text().split())
    bullet = text[text.index("- **[A]**, Intel Xeon with AMX") : text.index("- **Other CPU types**")]
    lo, hi = TOY_BASE_BAND
    inside = int(s["base"].between(lo, hi).sum())
    assert f"bases {s['base'].min():.3f}–{s['base'].max():.3f}, {inside} of {len(s)} in the band" in bullet
    math, code = s[s["task"] == "math"]["peak_heldout"], s[s["task"] == "code"]["peak_heldout"]
    assert f"peaks {code.min():.3f}–{code.max():.3f} (code) and {math.min():.3f}–{math.max():.3f}" in bullet
    g = s["gain_heldout"]
    assert f"gains {g.min():.3f}–{g.max():.3f}" in bullet, bullet
    low = sorted({(w, t) for w, t in zip(s[s["base"] < lo]["workflow"], s[s["base"] < lo]["task"])})
    assert low == [("eval_opt", "code"), ("orch_workers", "code"), ("orch_workers", "math")], low
    sharing = text[text.index("- **Sharing**") : text.index("- **GPUs**")]
    # the code rows' SP - IP from the committed paired table (test_analysis checks it is the data's rendering)
    rows = [r for r in (ev / "toy2/tables/paired.md").read_text().splitlines()
            if r.startswith("| sp-ip | sp | ip | heldout |") and "| code |" in r and "| all |" not in r]  # fmt: skip
    diffs = sorted(float(r.split("|")[13]) for r in rows)
    assert len(rows) == 3 and f"({diffs[-1]:.3f} to {diffs[0]:.3f})".replace("-", "−") in sharing
    slots = (ev / "toy_agents/tables/slots.md").read_text()
    amps = [float(r.split("|")[8].split()[0]) for r in slots.splitlines() if r.startswith("| voting | sp") or
            r.startswith("| voting | ip")]  # fmt: skip
    assert f"slot amplification {min(amps):.2f}–{max(amps):.2f}" in sharing, (amps, sharing)
    scale = text[text.index("- **Scale**") : text.index("- **GPUs**")]
    for exp in ("toy2s", "toy2"):
        o = pd.read_parquet(ev / exp / "summary.parquet").query("workflow == 'orch_workers'")["gain_heldout"]
        assert f"gains {o.min():.3f}–{o.max():.3f}" in scale, (exp, scale)


def test_results_three_seed_numbers_come_from_the_committed_evidence():
    """docs/results.md's prose on toy_seeds (bases per build and the band, the out-of-band cell, flags, median
    gains per build and seed, code peaks) is recomputed from results/evidence/toy_seeds/summary.parquet, so it
    cannot drift from the data."""
    import pandas as pd

    from marlflow.core.definitions import TOY_BASE_BAND

    s = pd.read_parquet(ROOT / "results/evidence/toy_seeds/summary.parquet")
    text = (ROOT / "docs/results.md").read_text()
    para = " ".join(
        text[
            text.index("What it shows, descriptively") : text.index("<!-- evidence: toy_seeds/claims")
        ].split()
    )
    lo, hi = TOY_BASE_BAND
    b0, b1 = s[s["build"] == 0], s[s["build"] == 1]
    assert len(b0) == len(b1) == 42, (len(b0), len(b1))
    # build 0: every base in the band, as the prose says
    assert (
        f"Build 0's bases are {b0['base'].min():.3f}–{b0['base'].max():.3f}, all in the designed band" in para
    )
    assert f"[{lo:.2f}, {hi:.2f}]" in para and b0["base"].between(lo, hi).all(), para
    # build 1: only Orch-Workers math outside the band, with its numbers
    ow = (s["workflow"] == "orch_workers") & (s["task"] == "math")
    out = b1[~b1["base"].between(lo, hi)]
    assert set(zip(out["workflow"], out["task"])) == {("orch_workers", "math")}, out
    o1, o0, rest = s[ow & (s["build"] == 1)], s[ow & (s["build"] == 0)], b1[~ow[b1.index]]
    assert f"Build 1's are {b1['base'].min():.3f}–{b1['base'].max():.3f}" in para, para
    assert f"Orch-Workers math base is {o1['base'].min():.3f}–{o1['base'].max():.3f}" in para, para
    pk, pk0 = o1["peak_heldout"], o0["peak_heldout"]
    assert f"(held-out peak {pk.min():.3f}–{pk.max():.3f}; build 0: base {o0['base'].min():.3f}–" in para, (
        para
    )
    assert f"{o0['base'].max():.3f}, peak {pk0.min():.3f}–{pk0.max():.3f})" in para, para
    assert f"13 other cells start at {rest['base'].min():.3f}–{rest['base'].max():.3f}, in the band" in para
    assert rest["base"].between(lo, hi).all()
    flags = s["cliff"].astype(bool) | s["collapse"].astype(bool) | s["stagnation"].astype(bool)
    assert f"({int(flags.sum())} of {len(s)};" in para and all(r in para for r in s[flags]["run_id"]), para
    med = s.groupby(["build", "seed"])["gain_heldout"].median()
    assert (
        f"median gain_heldout {' / '.join(f'{g:.3f}' for g in med[0])} for build 0's seeds 0 / 1 / 2" in para
    )
    assert f"and {' / '.join(f'{g:.3f}' for g in med[1])} for build 1's" in para, para
    code = s[s["task"] == "code"]["peak_heldout"]
    assert f"held-out peak is {code.min():.3f}–{code.max():.3f}" in para, para


def test_results_intervention_numbers_come_from_the_committed_evidence():
    """docs/results.md's prose on toy_interventions (the pooled terminal differences and their corrected
    intervals, the `none` runs' cliffs per cell, cliffs with and without each intervention, cliff_guard's restores
    and its Voting runs equal to `none`) is recomputed from results/evidence/toy_interventions."""
    import pandas as pd

    folder = ROOT / "results/evidence/toy_interventions"
    s = pd.read_parquet(folder / "summary.parquet")
    m = pd.read_parquet(folder / "metrics.parquet")
    text = (ROOT / "docs/results.md").read_text()
    para = " ".join(
        text[text.index("What it shows (descriptive beyond") : text.index("## What the toy matrix")].split()
    )
    assert len(s) == 48, len(s)
    # the pooled rows, as the quoted interventions table (checked against the data by test_analysis) has them
    rows = {}
    for line in (folder / "tables/interventions.md").read_text().splitlines()[2:]:
        c = [x.strip() for x in line.strip("|").split("|")]
        if c[2] == "terminal_mean3":
            rows[c[0]] = (float(c[6]), float(c[7]), float(c[8]), int(c[4]), c[11])
    assert {r[4] for r in rows.values()} == {"inconclusive"} and all(r[1] < 0 < r[2] for r in rows.values())
    kl, cg = rows["kl"], rows["cg"]
    assert f"I1 +{kl[0]:.3f} [{kl[1]:.3f}, {kl[2]:.3f}] over {kl[3]} pairs".replace("-", "−") in para, para
    assert f"cliff_guard +{cg[0]:.3f} [{cg[1]:.3f}, {cg[2]:.3f}] over {cg[3]}".replace("-", "−") in para, para
    for name, key in (("mass_balance", "mb"), ("coherence", "coh"), ("same_role_norm", "srn")):
        assert f"{name} {rows[key][0]:+.3f}".replace("-", "−") in para, (name, para)
    # the none runs' cliffs, per cell
    none = s[s["intervention"] == "none"]
    assert f"{int(none['cliff'].sum())} of {len(none)} `none` runs are flagged" in para, para
    names = {"voting": "Voting", "orch_workers": "Orch-Workers"}
    for (wf, sh), c in none.groupby(["workflow", "sharing"])["cliff"]:
        assert f"{names[wf]} {sh.upper()} {int(c.sum())} of {len(c)}" in para, (wf, sh, para)
    # cliffs with vs without, in the cells where each intervention ran
    labels = {
        "kl": "I1",
        "cg": "cliff_guard",
        "mb": "mass_balance",
        "coh": "coherence",
        "srn": "same_role_norm",
    }
    cell = ["workflow", "sharing", "task", "scale"]
    for key, label in labels.items():
        with_ = s[s["intervention"] == key]
        without = none.merge(with_[cell].drop_duplicates(), on=cell)
        assert f"{label} {int(with_['cliff'].sum())} vs {int(without['cliff'].sum())}" in para, (key, para)
    # cliff_guard: one restore in each Orch-Workers run, none under Voting, whose runs equal `none`'s
    restores = m[m["metric"] == "guard_restores"].groupby("run_id")["value"].max()
    cg_runs = s[s["intervention"] == "cg"]
    for rid, wf in zip(cg_runs["run_id"], cg_runs["workflow"], strict=True):
        assert restores.get(rid, 0) == (1 if wf == "orch_workers" else 0), (rid, restores.get(rid))
    timing = m["metric"].str.startswith("time_") | m["metric"].isin(
        ["step_time", "eval_reused", "generate_calls"]
    )
    key = ["step", "split", "role", "metric"]
    for rid in cg_runs[cg_runs["workflow"] == "voting"]["run_id"]:
        a = m[(m["run_id"] == rid) & ~timing]
        b = m[(m["run_id"] == rid.removesuffix("-cg")) & ~timing]
        j = a.merge(b, on=key, suffixes=("_cg", "_none"))
        assert (j["value_cg"] == j["value_none"]).all() and len(j) == len(b), rid
        assert f"value for value ({len(j):,} non-timing metric rows each)" in para


def test_results_one_seed_numbers_come_from_the_committed_evidence():
    """docs/results.md's prose on the one-seed toy evidence (gains, bases and the out-of-band cell, peaks per task,
    careless shares, the paired SP - IP verdicts and the paired cliff) is recomputed from results/evidence/toy."""
    import pandas as pd

    from marlflow.analysis.paired import paired_cliffs, paired_contrasts
    from marlflow.core.definitions import TOY_BASE_BAND

    folder = ROOT / "results/evidence/toy"
    s = pd.read_parquet(folder / "summary.parquet")
    m = pd.read_parquet(folder / "metrics.parquet")
    o = pd.read_parquet(folder / "outcomes.parquet")
    text = (ROOT / "docs/results.md").read_text()
    para = " ".join(
        text[text.index("What one seed shows here") : text.index("## Three seeds on two toy builds")].split()
    )
    g, b = s["gain_heldout"], s["base"]
    assert (g > 0).all() and f"all {len(s)} runs gain (held-out gain {g.min():.3f}–{g.max():.3f})" in para
    assert f"bases {b.min():.3f}–{b.max():.3f}" in para
    low = s[b < TOY_BASE_BAND[0]]
    assert (
        list(zip(low.workflow, low.task)) == [("eval_opt", "code")] * 2
        and f"Eval-Opt code's {b.min():.3f}" in para
    )
    code, math = s[s.task == "code"]["peak_heldout"], s[s.task == "math"]["peak_heldout"]
    assert (
        f"code peaks {code.min():.3f}–{code.max():.3f}" in para
        and f"math peaks {math.min():.3f}–{math.max():.3f}" in para
    )
    c = m[(m.metric == "careless_share") & (m.role == "all")].pivot_table(
        index="run_id", columns="step", values="value"
    )
    assert f"goes from {c[0].min():.2f}–{c[0].max():.2f} at step 0 to 0.00 at step 40" in para
    ow = c.index.str.startswith("orch_workers") & c.index.str.contains("math")
    assert (c.loc[~ow, 40] == 0).all() and (c.loc[ow, 40].round(2) == 0.50).all()
    declared = json.loads((folder / "provenance.json").read_text())["analysis"]["paired"]
    pairs = paired_contrasts(o, s, declared)
    primary = pairs[pairs["at"] == "heldout"]
    assert len(primary) == 8 and (primary["verdict"] == "no difference shown").all()
    d = primary[(primary.task == "math") & (primary.workflow != "all")]["diff"]
    assert f"math differences are {d.min():.3f}–{d.max():.3f}" in para
    cl = paired_cliffs(o, s)
    flagged = cl[cl["cliff_paired"]]
    assert (
        list(flagged.run_id) == ["voting-ip-toy-math-s0"]
        and not s.set_index("run_id").loc[flagged.run_id, "cliff"].any()
    )
    r = flagged.iloc[0]
    assert f"({r.acc_peak:.3f} → {r.acc_terminal:.3f} on the same problems, p = {r.p:.3f})" in para
    assert f"comes about {100 * (1 - (1 - 0.0345) ** len(s)):.0f}% of the time" in para
