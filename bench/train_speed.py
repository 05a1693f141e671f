"""Training time at equal accuracy: two commits' `shortlist train` interleaved in one run.

    python bench/train_speed.py --base /path/to/base-worktree [--new .] [--seeds 0,1,2]
                                [--data /work/shared/data/debian-deps] [--threads 1] [--publish]
    python bench/train_speed.py --base ... --summarize [--publish]   # the table of the rows so far

Each worktree trains with its own venv (`WORKTREE/.venv/bin/shortlist`), seed by seed, the two
commits alternating (base first on even seeds, new first on odd ones, so a drift of the shared
machine's load falls on both), each training under `nice -n 19` with `threads` torch threads.
Each checkpoint is exported by its own commit and scored by this tree's engine on the bundle
(`shortlist eval --filter own`, the XC filtered protocol, and plain beside it): what is
evaluated is what is served. Prints each training's wall time and stage times (the
checkpoint's metrics, where the commit records them), the wall-time ratio base / new and the
seed means of P@1, P@5, PSP@5 under both protocols; --publish writes them to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import BENCH_DIR, command_line, replace_section

METRICS = ("P@1", "P@5", "PSP@5")
PROTOCOLS = ("own", "plain")
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def revision(tree: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True,
                           text=True).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Runs cmd with its stderr appended to log; wall seconds and stdout. Fails loudly."""
    t0 = time.perf_counter()
    with log.open("a") as err:
        err.write(f"$ {' '.join(cmd)}\n")
        err.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return time.perf_counter() - t0, proc.stdout


def train_one(name: str, tree: Path, seed: int, args: argparse.Namespace, engine: Path) -> dict[str, Any]:
    """train -> export (by `tree`'s commit) -> eval of the bundle by `engine`'s; one row."""
    out = args.out / f"{name}-s{seed}"
    log = args.out / f"{name}-s{seed}.log"
    cli = str(tree / ".venv" / "bin" / "shortlist")
    cfg = args.out / f"{name}-config.json"
    cfg.write_text(json.dumps({"threads": args.threads}))
    env = ONE_THREAD_ENV if args.threads == 1 else {}
    print(f"[{time.strftime('%H:%M:%S')}] {name} seed {seed}: training", flush=True)
    train_s, _ = run_logged(["nice", "-n", "19", cli, "train", "--data", str(args.data), "--out", str(out / "ckpt"),
                             "--config", str(cfg), "--seed", str(seed)], log, env)
    run_logged([cli, "export", str(out / "ckpt"), "--out", str(out / "bundles"), "--version", "b"], log)
    metrics = json.loads((out / "ckpt" / "checkpoint.json").read_text()).get("metrics", {})
    row: dict[str, Any] = {"name": name, "seed": seed, "train_s": train_s, "stages": metrics.get("times", {}),
                           "peak_rss_mib": metrics.get("peak_rss_mib", {}), "validation": _validation(metrics)}
    for protocol in PROTOCOLS:
        _, text = run_logged([str(engine / ".venv" / "bin" / "shortlist"), "eval", str(out / "bundles" / "b"),
                              "--data", str(args.data), "--filter", protocol, "--json"], log)
        row[protocol] = {m: json.loads(text)[m] for m in METRICS}
    print(f"    {train_s:.1f} s  own P@1 {row['own']['P@1']:.2f}  stages {row['stages']}", flush=True)
    return row


def _validation(metrics: dict[str, Any]) -> dict[str, float]:
    """The served scoring's validation metrics the training tuned on (own labels left out)."""
    tuned = metrics.get("validation", {})
    return {m: tuned[m] for m in METRICS if m in tuned}


def summary(rows: list[dict[str, Any]], names: dict[str, str]) -> str:
    """The markdown table: per commit mean training time and seed-mean metrics over the seeds
    both commits trained; the ratio."""
    done = {r["seed"] for r in rows if r["name"] == "base"} & {r["seed"] for r in rows if r["name"] == "new"}
    rows = [r for r in rows if r["seed"] in done]
    lines = ["| commit | seeds | train (s), mean | " + " | ".join(f"{m} own" for m in METRICS) + " | "
             + " | ".join(f"{m} plain" for m in METRICS) + " |", "|---" * (3 + 2 * len(METRICS)) + "|"]
    means: dict[str, float] = {}
    for name, rev in names.items():
        mine = [r for r in rows if r["name"] == name]
        means[name] = float(np.mean([r["train_s"] for r in mine]))
        cells = [f"{np.mean([r[p][m] for r in mine]):.2f}" for p in PROTOCOLS for m in METRICS]
        lines.append(f"| {name} ({rev}) | {len(mine)} | {means[name]:.1f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Training wall time base / new: {means['base'] / means['new']:.2f}x (mean over seeds).")
    lines.append("")
    lines.append("Per training (wall s; stage times from the checkpoint's metrics where recorded):")
    lines.append("")
    for r in rows:
        stages = ", ".join(f"{k.removesuffix('_s')} {v:.0f}" for k, v in r["stages"].items() if k != "total_s")
        own = " / ".join(f"{r['own'][m]:.2f}" for m in METRICS)
        val = " / ".join(f"{v:.2f}" for v in r.get("validation", {}).values())
        lines.append(f"- {r['name']} seed {r['seed']}: {r['train_s']:.1f} s; test own P@1/P@5/PSP@5 {own}"
                     + (f"; validation (tuning's, own left out) {val}" if val else "")
                     + (f"; {stages}" if stages else ""))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="worktree of the baseline commit, with its .venv")
    p.add_argument("--new", type=Path, default=BENCH_DIR.parent, help="worktree of the new commit (default: this)")
    p.add_argument("--data", type=Path, default=Path("/work/shared/data/debian-deps"))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each training (config `threads`)")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "train_speed")
    p.add_argument("--publish", action="store_true", help="write the table to bench/RESULTS.md")
    p.add_argument("--summarize", action="store_true", help="no training: the table of --out's rows so far")
    p.add_argument("--only", choices=["base", "new"], default=None,
                   help="train this commit alone, added to --out's rows (a re-run of one side)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    revisions = args.out / "revisions.json"  # the commits the rows were trained at
    names = json.loads(revisions.read_text()) if revisions.is_file() else {}
    if not args.summarize:
        names.update({name: revision(tree) for name, tree in trees.items() if args.only in (None, name)})
        revisions.write_text(json.dumps(names))
    names.update({name: revision(tree) for name, tree in trees.items() if name not in names})
    rows = json.loads((args.out / "rows.json").read_text()) if args.summarize or args.only else []
    rows = [r for r in rows if r["name"] != args.only]
    for row in rows:  # rows written before validation was recorded: read from their checkpoints
        ckpt = args.out / f"{row['name']}-s{row['seed']}" / "ckpt" / "checkpoint.json"
        if ckpt.is_file():
            row.setdefault("validation", _validation(json.loads(ckpt.read_text()).get("metrics", {})))
    for i, seed in enumerate([] if args.summarize else [int(s) for s in args.seeds.split(",")]):
        order = ["base", "new"] if i % 2 == 0 else ["new", "base"]
        for name in [n for n in order if args.only in (None, n)]:
            rows.append(train_one(name, trees[name], seed, args, trees["new"]))
            (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    body = summary(rows, names)
    print(body)
    if args.publish:
        header = (f"Command: `{command_line()}`\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                  f"data {args.data.name}, {args.threads} torch thread(s) a training, nice 19, 2 cores shared.\n\n")
        replace_section(BENCH_DIR / "RESULTS.md", "train-speed", header + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
