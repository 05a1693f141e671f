"""Labels added live without a training per draw: the model trained with every label, its held-out
labels retired and added back by their text, over several draws of held-out labels.

    python bench/live_labels_proxy.py --data DIR --bundle TRAINED --checkpoint CKPT [--filter own]
                                      [--seeds 0,1,2,3,4] [--holdout 0.1] [--out DIR] [--no-test]

bench/live_labels.py trains a model without the held-out labels (over an hour on debian-deps on
the shared CPU), for one draw. This takes the model trained with them (live_labels' "retrained")
and, for each seed's draw (live_labels.held_out_mask, the draw live_labels makes), derives
through the service's LabelEditor:
- "held-out": the bundle with the held-out labels retired (never returned by any scorer);
- "live": that bundle with the held-out labels added back by their text (uid + LIVE_SUFFIX), at
  the editor's defaults; the same served with k_added 50, without the overflow rows, every
  label scored; and added with prior hints (live_labels.prior_hints: how common each label is,
  which its text does not say).
The encoder saw the held-out labels' texts and their documents in training, so an added label's
text embedding sits nearer its documents than a never-seen label's would: the live figures are
an upper bound on what adding them to a model that never saw them gives (live_labels measures
that). Scored on the checkpoint's validation documents (no model trained on them) and, unless
--no-test, the test documents; recall on the held-out labels averaged over documents (as
live_labels reports it) and over labels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import OUT_DIR, command_line, git_revision, read_jsonl
from live_labels import (
    Truth,
    bundle_predictions,
    held_out_mask,
    new_labels,
    prior_hints,
    validation_documents,
)

from service.engine import PredictorOptions
from service.engine.bundle import Bundle
from service.engine.label_changes import LabelChange, LabelEditor

LIVE_SUFFIX = "#live"
# name -> (bundle, options, exact, without_overflow); "retrained" is the trained bundle itself.
VARIANTS = {"held-out": ("held-out", None, False, False), "live": ("live", None, False, False),
            "live exact": ("live", None, True, False),
            "live k_added 50": ("live", PredictorOptions(k_added=50), False, False),
            "live without overflow": ("live", None, False, True),
            "live with prior hints": ("hinted", None, False, False),
            "live with prior hints, exact": ("hinted", None, True, False),
            "live with prior hints, k_added 50": ("hinted", PredictorOptions(k_added=50), False, False)}


def derive_draw(trained: Path, data: Path, held_uids: list[str], out: Path) -> dict[str, Path]:
    """out/held-out, out/live, out/hinted: the trained bundle with the held-out labels retired,
    then added back by their text (without and with prior hints)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    hints = prior_hints(data, held_uids)
    added = [dataclasses.replace(lab, uid=lab.uid + LIVE_SUFFIX) for lab in new_labels(data, held_uids)]
    editor = LabelEditor()
    with_parent(trained, lambda b: editor.derive(b, LabelChange(retire=held_uids), out, "held-out"))
    timed = {}
    for name, labels in (("live", added), ("hinted", [dataclasses.replace(a, prior=hints[a.uid[: -len(LIVE_SUFFIX)]])
                                                        for a in added])):
        t0 = time.perf_counter()
        with_parent(out / "held-out", lambda b, labels=labels, name=name: editor.derive(b, LabelChange(add=labels),
                                                                                       out, name))
        timed[name] = time.perf_counter() - t0
    print(f"[proxy] derived in {timed}", flush=True)
    return {name: out / name for name in ("held-out", "live", "hinted")}


def with_parent(path: Path, change: Any) -> None:
    parent = Bundle.open(path)
    try:
        change(parent)
    finally:
        parent.close()


def score_draw(bundles: dict[str, Path], truth: Truth, own_excluded: bool,
               retrained: np.ndarray) -> dict[str, dict[str, Any]]:
    rows = {"retrained": truth.metrics(retrained, own_excluded)}
    for name, (which, options, exact, without_overflow) in VARIANTS.items():
        preds = bundle_predictions(bundles[which], truth, options, exact=exact, without_overflow=without_overflow)
        rows[name] = truth.metrics(preds, own_excluded)
        m = rows[name]
        print(f"[proxy] {name}: P@1 {m['P@1']:.2f} held R@10 {m['held R@10']:.2f} labels {m['held R@10 labels']:.2f} "
              f"top {m['top_held']}", flush=True)
    return rows


def render(result: dict[str, Any]) -> str:
    a = result["args"]
    out = [f"### Labels added live, proxy over draws: {a['dataset']} ({a['holdout']:.0%} of the labels per draw)", "",
           f"Command: `{result['command']}` (commit {result['commit']}, {result['date']}; other agents shared the "
           "2-core CPU). The trained bundle's held-out labels retired and added back by their text; its encoder saw "
           "them, so the live figures are an upper bound (see the script's docstring). held R@10: recall@10 on the "
           "held-out labels averaged over the documents that have one / over the held-out labels; ratio: live "
           "(served) over retrained.", "",
           "| draw | documents | most frequent held-out label (documents) | system | P@1 | held R@10 docs | "
           "held R@10 labels | ratio docs | ratio labels |", "|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        rows = run["metrics"]
        re_ = rows["retrained"]
        top = re_["top_held"]
        for name in ("retrained", *VARIANTS):
            m = rows[name]
            ratio = (f"{100 * m['held R@10'] / max(re_['held R@10'], 1e-9):.1f}% | "
                     f"{100 * m['held R@10 labels'] / max(re_['held R@10 labels'], 1e-9):.1f}%"
                     if name != "retrained" else "| ")
            out.append(f"| {run['seed']} | {run['split']}, {a['protocol']} | {top['uid']} ({top['docs']} of "
                       f"{re_['held_docs']}) | {name} | {m['P@1']:.2f} | {m['held R@10']:.2f} | "
                       f"{m['held R@10 labels']:.2f} | {ratio} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--bundle", required=True, help="a bundle trained on every label")
    p.add_argument("--checkpoint", required=True, help="its checkpoint (which training documents validated it)")
    p.add_argument("--filter", default="plain", choices=["plain", "own"])
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--holdout", type=float, default=0.1)
    p.add_argument("--out", default=None)
    p.add_argument("--test", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    from training.data import find_split_file

    data, trained = Path(args.data).resolve(), Path(args.bundle).resolve()
    out = Path(args.out or OUT_DIR / f"live-proxy-{data.name}").resolve()
    label_uids = [str(r["uid"]) for r in read_jsonl(find_split_file(data, "lbl"))]
    splits = {"validation": validation_documents(read_jsonl(find_split_file(data, "trn")), Path(args.checkpoint))}
    if args.test:
        splits["test"] = read_jsonl(find_split_file(data, "tst"))
    own = args.filter == "own"
    retrained = {split: bundle_predictions(trained, Truth(data, [], docs)) for split, docs in splits.items()}
    result: dict[str, Any] = {"command": command_line(), "commit": git_revision(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        held_uids = [u for u, h in zip(label_uids, held_out_mask(len(label_uids), args.holdout, seed), strict=True)
                     if h]
        bundles = derive_draw(trained, data, held_uids, out / f"seed-{seed}")
        aliases = {u + LIVE_SUFFIX: u for u in held_uids}
        for split, docs in splits.items():
            print(f"[proxy] seed {seed}, {split}", flush=True)
            metrics = score_draw(bundles, Truth(data, held_uids, docs, aliases), own, retrained[split])
            result["runs"].append({"seed": seed, "split": split, "metrics": metrics})
        shutil.rmtree(out / f"seed-{seed}", ignore_errors=True)
    result["args"] = {**vars(args), "dataset": data.name,
                      "protocol": "own label excluded" if own else "plain"}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
