"""Training's OpenMP waits: `shortlist train` with libgomp's own default (OMP_WAIT_POLICY unset:
threads spin at a barrier a while before they sleep; the command run with its setting of it,
shortlist.cli.passive_openmp_waits, turned off) against the command as it is (PASSIVE), on an idle
machine and beside busy processes (a CPU-bound loop each, as another job or a serving process on
the same machine would be).

    python bench/train_threads.py --data ../shared/data/debian-tags [--config FILE] [--hogs 1] [--rounds 2]
        [--timeout 1800]

The two variants alternate within each round; the config defaults to the training's defaults
with the tree off (a quicker run: the tree's own fits are not what is compared). Prints each
run's wall seconds and Module I / III seconds, and the ratio default / PASSIVE per condition.
A run past --timeout is stopped and reported as at least that long.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import command_line, git_revision

# How each variant starts `shortlist`: the first without the command's setting of OMP_WAIT_POLICY.
UNSET = "import sys, shortlist.cli as c; c.passive_openmp_waits = lambda environ: None; sys.exit(c.main())"
VARIANTS = {"libgomp default": [sys.executable, "-c", UNSET],
            "PASSIVE (the command's)": [str(Path(sys.executable).with_name("shortlist"))]}


def _hogs(n: int) -> list[subprocess.Popen]:
    """n busy processes, each ending when this one does (even killed: it checks its parent)."""
    code = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def _train(data: Path, config: Path, command: list[str], timeout: float) -> dict[str, float | bool]:
    """One `shortlist train`: its wall seconds, Module I and III seconds (None if stopped)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    with tempfile.TemporaryDirectory(prefix="train-threads-") as out:
        started = time.monotonic()
        try:
            subprocess.run([*command, "train", "--data", str(data), "--out", f"{out}/ck", "--config", str(config)],
                           env=env, check=True, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"seconds": timeout, "stopped": True}
        took = time.monotonic() - started
        times = json.loads(Path(f"{out}/ck/checkpoint.json").read_text())["metrics"]["times"]
    return {"seconds": took, "stopped": False, "module1_s": times["module1_s"], "module3_s": times["module3_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--config", type=Path, default=None, help="training config (default: the defaults, tree off)")
    ap.add_argument("--hogs", type=int, default=1, help="busy processes beside training in the busy condition")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    config = args.config
    if config is None:
        config = Path(tempfile.mkdtemp(prefix="train-threads-")) / "config.json"
        config.write_text(json.dumps({"tree_enabled": False}))
    print(f"`{command_line()}` at {git_revision()}, {os.cpu_count()} cores", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    for condition, hogs in (("idle", 0), (f"{args.hogs} busy process(es)", args.hogs)):
        for _ in range(args.rounds):
            for name, command in VARIANTS.items():
                busy = _hogs(hogs)
                try:
                    run = _train(args.data, config, command, args.timeout)
                finally:
                    for p in busy:
                        p.kill()
                        p.wait()
                runs.setdefault((condition, name), []).append(run)
                print(f"{condition}, {name}: {_shown(run)}", flush=True)
    for condition in dict.fromkeys(c for c, _ in runs):
        base, new = (min(r["seconds"] for r in runs[condition, name]) for name in VARIANTS)
        print(f"{condition}: libgomp default / PASSIVE = {base / new:.2f} (best of {args.rounds} each)")
    return 0


def _shown(run: dict) -> str:
    if run["stopped"]:
        return f">= {run['seconds']:.0f} s (stopped)"
    return f"{run['seconds']:.1f} s (Module I {run['module1_s']:.1f} s, Module III {run['module3_s']:.1f} s)"


if __name__ == "__main__":
    sys.exit(main())
