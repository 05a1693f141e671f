"""`shortlist demo`: build the demo bundle if none exists, then serve it.

The demo data is generated (seeded, in the XC raw-text format), so a fresh clone needs
nothing else; a user with real data runs `shortlist train`, `export` and `serve` instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from service.engine.bundle import BundleError, newest_version

DEMO_DATA = {"num_labels": 2000, "train_docs": 10000, "test_docs": 2000, "seed": 0}
DEMO_VERSION = "demo-v1"


def demo_config() -> dict:
    from training.train import TrainConfig

    cfg = dataclasses.asdict(TrainConfig.tiny())
    cfg.update({"dim": 128, "m1_epochs": 6, "m3_epochs": 6, "progress": True})
    return cfg


def build_demo(workdir: Path) -> Path:
    """Generate data, train, export and evaluate; returns the bundle root."""
    from model_export.evaluate import evaluate_bundle
    from model_export.export import export_checkpoint
    from training.synthetic import generate
    from training.train import TrainConfig, train

    data = workdir / "data"
    root = workdir / "bundles"
    if not (data / "lbl.json.gz").is_file():
        print(f"generating demo data in {data}")
        generate(data, **DEMO_DATA)
    ckpt_dir = workdir / "checkpoint"
    if not (ckpt_dir / "checkpoint.json").is_file():
        print("training the demo model (Modules I-III) ...")
        train(data, TrainConfig.from_dict(demo_config())).save(ckpt_dir)
    bundle = export_checkpoint(ckpt_dir, root, DEMO_VERSION)
    result = evaluate_bundle(bundle, data)
    print("held-out metrics through the engine:", json.dumps({k: round(v, 2) for k, v in result.items()
                                                              if isinstance(v, float)}))
    return root


def run_cli(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    root = workdir / "bundles"
    try:
        version = newest_version(root)
        print(f"demo bundle {root / version} exists; serving it (delete {workdir} to rebuild)")
    except BundleError:
        build_demo(workdir)
    if args.build_only:
        return 0
    from service.api.server import run_cli as serve

    print(f"serving on http://{args.host}:{args.port}  (try: curl -s -XPOST http://{args.host}:{args.port}"
          "/v1/predict -H 'content-type: application/json' -d '{\"text\": \"fast network tool\", \"k\": 5}')")
    return serve(argparse.Namespace(bundle_root=str(root), version=None, host=args.host, port=args.port))
