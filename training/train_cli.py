"""`shortlist train`: the CLI shell over training.pipeline.train and, for grouped data,
training.aggregated.train_aggregated."""

from __future__ import annotations

import argparse
import logging
import sys

from service.engine.jsonlines import strict_dumps
from training.aggregated import train_aggregated
from training.checkpoint import Checkpoint, check_save_target
from training.config import TrainConfig, read_config_file
from training.pipeline import refit_tree, retune, train
from training.tree_config import resolve_config as resolve_tree_config


def run_cli(args: argparse.Namespace) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(message)s")
    if args.refit_tree and args.retune:
        raise ValueError("--refit-tree and --retune: one at a time")
    check_save_target(args.out)  # before training: a refusal after it lost hours of it
    if args.refit_tree:
        return _refit_tree(args)
    if args.retune:
        return _retune(args)
    cfg = TrainConfig.from_json(args.config) if args.config else TrainConfig()
    flags = {"seed": args.seed, "aggregated_rounds": args.aggregated_rounds}
    cfg = TrainConfig.from_dict({k: v for k, v in flags.items() if v is not None}, cfg)  # checked as the file's
    if args.aggregated:
        ckpt = train_aggregated(args.data, cfg, text_field=args.text_field, seed=args.seed)
    else:
        ckpt = train(args.data, cfg, text_field=args.text_field, seed=args.seed)
    return _save(ckpt, args.out)


def _refit_tree(args: argparse.Namespace) -> int:
    overrides: dict = {}
    if args.config:
        overrides = read_config_file(args.config)
        if set(overrides) - {"tree"}:
            raise ValueError(f"{args.config}: with --refit-tree the config may hold only a \"tree\" object")
        try:  # before the checkpoint is read: a bad setting is named at once
            resolve_tree_config(overrides.get("tree", {}))
        except ValueError as exc:
            raise ValueError(f"{args.config}: {exc}") from None
    if args.aggregated or args.seed is not None:
        raise ValueError("--refit-tree keeps the checkpoint's data and seed: drop --aggregated and --seed")
    return _save(refit_tree(args.refit_tree, args.data, overrides.get("tree")), args.out)


def _retune(args: argparse.Namespace) -> int:
    overrides: dict = {}
    if args.config:
        overrides = read_config_file(args.config)
    if args.aggregated or args.seed is not None:
        raise ValueError("--retune keeps the checkpoint's data and seed: drop --aggregated and --seed")
    return _save(retune(args.retune, args.data, overrides), args.out)


def _save(ckpt: Checkpoint, out_dir: str) -> int:
    out = ckpt.save(out_dir)
    print(strict_dumps({"checkpoint": str(out), "metrics": ckpt.metrics, "scoring": ckpt.scoring.model_dump()},
                       "the training's record", indent=2))
    return 0
