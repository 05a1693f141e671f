"""`shortlist train`: the CLI shell over training.pipeline.train and, for grouped data,
training.aggregated.train_aggregated."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace

from training.aggregated import train_aggregated
from training.config import TrainConfig
from training.pipeline import train


def run_cli(args: argparse.Namespace) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = TrainConfig.from_json(args.config) if args.config else TrainConfig()
    if args.aggregated_rounds is not None:
        cfg = replace(cfg, aggregated_rounds=args.aggregated_rounds)
    if args.aggregated:
        ckpt = train_aggregated(args.data, cfg, text_field=args.text_field, seed=args.seed)
    else:
        ckpt = train(args.data, cfg, text_field=args.text_field, seed=args.seed)
    out = ckpt.save(args.out)
    print(json.dumps({"checkpoint": str(out), "metrics": ckpt.metrics, "scoring": ckpt.scoring.model_dump()},
                     indent=2))
    return 0
