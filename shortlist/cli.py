"""`shortlist` console command.

Each subcommand's implementation is imported only when it runs, so `shortlist serve`
works where torch (a training-only dependency) is not installed.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _seed(text: str) -> int:
    """A seed as training takes one: numpy's "expected non-negative integer" named no flag."""
    from training.config_values import MAX_SEED  # light: no torch

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {MAX_SEED}], got {text!r}")
    return value


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a SiameseXML model on an XC raw-text dataset")
    p.add_argument("--data", required=True, help="folder with trn.json(.gz|l) and lbl.json(.gz|l)")
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--text-field", default="title", choices=["title", "title+content"])
    p.add_argument("--config", help="JSON file of hyper-parameters overriding the defaults")
    p.add_argument("--seed", type=int, default=None, help="overrides the config's seed")
    p.add_argument("--aggregated", action="store_true",
                   help="grouped data (labels per group of documents, training/grouped.py): impute per-document "
                        "labels with EAGLE, then train on them")
    p.add_argument("--aggregated-rounds", type=int, default=None,
                   help="rounds of imputation and training: each after the first re-imputes from the model "
                        "trained before it (config aggregated_rounds, aggregated_reimpute)")
    p.add_argument("--refit-tree", metavar="CKPT",
                   help="keep CKPT (trained on the same --data) and fit only its tree route again; --config may "
                        "hold only a \"tree\" object overriding CKPT's")
    p.add_argument("--retune", metavar="CKPT",
                   help="keep CKPT (trained on the same --data) and tune only its scoring and served sources again "
                        "on its validation split; --config may hold only the tuning's keys (tune_*, serve_k_*, "
                        "alpha, exclude_own_labels) overriding CKPT's, and index_* keys, which build its HNSW "
                        "indices again first")
    p.set_defaults(handler="training.train_cli:run_cli")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate-data", help="write a seeded synthetic dataset in XC raw-text format")
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default="small", choices=["small", "scale"],
                   help="small: the demo's and tests' easy data; scale: XC-shaped data for 10^4..10^6+ labels "
                        "(Zipf 1.1 label frequencies, clusters of related labels, training/synthetic_scale.py)")
    p.add_argument("--labels", type=int, default=2000)
    p.add_argument("--train-docs", type=int, default=None, help="default: 8000 (small), as many as labels (scale)")
    p.add_argument("--test-docs", type=int, default=None, help="default: 2000 (small), a tenth of trn (scale)")
    p.add_argument("--seed", type=_seed, default=0)
    p.set_defaults(handler="training.synthetic:run_cli")


def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="dataset tools")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    a = data_sub.add_parser("aggregate", help="grouped data (labels per group of documents) from an ordinary dataset")
    a.add_argument("--data", required=True, help="an XC raw-text dataset folder")
    a.add_argument("--out", required=True, help="folder to write the grouped dataset to")
    a.add_argument("--group-size", type=int, required=True)
    a.add_argument("--grouping", default="random", choices=["random", "clustered"],
                   help="clustered: leaves of a balanced hierarchical 2-means on TF-IDF (alike documents together)")
    a.add_argument("--seed", type=_seed, default=0)
    a.set_defaults(handler="training.aggregate_data:run_cli")
    i = data_sub.add_parser("import-arff", help="a multi-label ARFF dataset (MULAN's or MEKA's layout) as an "
                            "XC raw-text dataset, split at random")
    i.add_argument("--arff", type=Path, required=True, help="the .arff file (or .arff.gz)")
    i.add_argument("--labels-xml", type=Path, help="MULAN's label file (else MEKA's -C N in the relation name)")
    i.add_argument("--out", type=Path, required=True, help="folder to write trn/tst/lbl.json.gz to")
    i.add_argument("--test-fraction", type=float, default=0.3)
    i.add_argument("--seed", type=_seed, default=0)
    i.set_defaults(handler="training.arff_data:run_cli")


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="turn a checkpoint into an immutable, versioned bundle")
    p.add_argument("checkpoint", help="checkpoint folder written by `shortlist train`")
    p.add_argument("--out", required=True, help="bundle root; the bundle is written to OUT/VERSION")
    p.add_argument("--version", help="bundle version name (default: a UTC timestamp)")
    p.add_argument("--ef-search", type=int, default=None)
    p.add_argument("--parity-texts", type=int, default=1000, help="texts in the ONNX parity check")
    p.add_argument("--encoder-dtype", choices=("int8", "float16", "float32"), default=None,
                   help="storage of the encoder's token embedding table (default int8: a float32 scale per "
                        "row, a quarter of float32's serving memory; float16 half; the embeddings are computed "
                        "in float32 either way)")
    p.add_argument("--vector-dtype", choices=("float16", "float32", "int8"), default=None,
                   help="storage of the label vectors (default: the training config's vector_dtype, the "
                        "values its scoring was tuned on; int8: a float32 scale per row, half float16's memory)")
    p.set_defaults(handler="model_export.export:run_cli")


def _add_labels(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("labels", help="add or retire labels of a bundle without retraining (a new bundle version)")
    labels_sub = p.add_subparsers(dest="labels_command", required=True)
    for name, text in (("add", "add labels by their text"), ("remove", "retire labels: never returned again")):
        c = labels_sub.add_parser(name, help=text)
        c.add_argument("bundle", help="the bundle folder to derive from (left unchanged)")
        if name == "add":
            c.add_argument("--labels", required=True,
                           help='JSON lines {"uid", "title", "content"?} (an XC label file; .gz allowed)')
        else:
            c.add_argument("uids", nargs="*", help="uids of the labels to retire")
            c.add_argument("--uids-file", help="more uids, one a line")
        c.add_argument("--out", help="bundle root to write to (default: the bundle's own root)")
        c.add_argument("--version", help="the new version's name (default: BASE.labels-N)")
        c.set_defaults(handler="service.api.label_file:run_cli")


def _add_shard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("shard", help="split a bundle's labels into N shard bundles (for `shortlist serve-ray`)")
    p.add_argument("bundle", help="bundle folder")
    p.add_argument("--shards", type=int, required=True, help="number of shards N")
    p.add_argument("--out", required=True, help="root to write OUT/VERSION/shard-I-of-N into (VERSION: the bundle's)")
    p.set_defaults(handler="model_export.shard:run_cli")




def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a bundle through the serving engine")
    p.add_argument("bundle", help="bundle folder")
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="tst")
    p.add_argument("--text-field", default=None, choices=["title", "title+content"],
                   help="default: the field the bundle was trained on")
    p.add_argument("--scorer", default="alpha", choices=["alpha", "tree"])
    p.add_argument("--alpha", type=float, default=None)
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N documents only")
    p.add_argument("--filter", default="plain", metavar="plain|own|FILE",
                   help="own: leave each document's own label (same uid) out of its predictions and truth (the XC "
                        "repository's filtered protocol); FILE: an XC filter file of 'test_row label_row' pairs")
    p.add_argument("--leave-out-retired", action="store_true",
                   help="score only the truths the bundle can answer: its retired labels left out of each "
                        "document's truth, a document with only retired truths not scored (as the quality gate "
                        "scores). Default: retired truths count as missed, and their number is printed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler="model_export.evaluate:run_cli")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a bundle over HTTP")
    p.add_argument("--bundle-root", default=None)
    p.add_argument("--version", default=None,
                   help="the version to serve when the state dir records none (the version last activated "
                        "there is served instead, a restart keeping it); default: the newest bundle")
    p.add_argument("--state-dir", default=None, help="writable directory that remembers the active version")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--processes", type=int, default=None,
                   help="serving processes on the port (default 1; more need --state-dir)")
    p.set_defaults(handler="service.api.server:run_cli")


def _positive_seconds(text: str) -> float:
    """A timeout flag's value: a finite number of seconds above 0. -1 or nan reached urllib and
    were reported as the server not being ready ("Timeout value out of range"), exit 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def _add_healthcheck(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("healthcheck", help="exit 0 when the local `shortlist serve` (SHORTLIST_HOST, SHORTLIST_PORT) "
                                           "is ready (/readyz 200), else 1: the images' HEALTHCHECK")
    p.add_argument("--timeout", type=_positive_seconds, default=2.0, help="seconds to wait for the answer (> 0)")
    p.set_defaults(handler="service.api.healthcheck:run_cli")


def _add_serve_ray(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-ray", help="serve sharded bundles (`shortlist shard`) on Ray Serve (the ray extra)")
    p.add_argument("--bundle-root", required=True, help="ROOT of ROOT/VERSION/shard-I-of-N")
    p.add_argument("--shards", type=int, required=True, help="shards per version (N)")
    p.add_argument("--replicas", type=int, default=1, help="replicas of each shard")
    p.add_argument("--version", default=None,
                   help="the version to serve when the state dir records none (the version last activated "
                        "there is served instead); default: the newest")
    p.add_argument("--state-dir", default=None, help="writable directory that remembers the active version")
    # Defaults None: SHORTLIST_HOST / SHORTLIST_PORT (else 127.0.0.1:8000) when not given, as for `serve`.
    p.add_argument("--host", default=None, help="default: SHORTLIST_HOST, else 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: SHORTLIST_PORT, else 8000")
    p.add_argument("--address", default=None,
                   help="a running Ray cluster (ray.init's address, e.g. auto); default: start a local one")
    p.add_argument("--num-cpus", type=float, default=None,
                   help="CPUs of the local Ray instance (default: the machine's)")
    p.add_argument("--shard-num-cpus", type=float, default=None, help="Ray's CPU reservation per shard replica")
    p.add_argument("--ingress-num-cpus", type=float, default=None, help="Ray's CPU reservation for the ingress")
    p.set_defaults(handler="service.api.ray_serve_cli:run_cli")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="build the demo bundle if missing, then serve it")
    p.add_argument("--workdir", default=".demo")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--dataset", default="auto", choices=["auto", "synthetic", "debian"],
                   help="auto: the machine's Debian package lists when present, else generated data")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(handler="shortlist.demo:run_cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shortlist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_generate, _add_data, _add_export, _add_labels, _add_shard, _add_eval, _add_serve,
                _add_healthcheck, _add_serve_ray, _add_demo):
        add(sub)
    return parser


def passive_openmp_waits(environ: dict[str, str] | os._Environ[str]) -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment sets it or GOMP_SPINCOUNT: torch's OpenMP
    threads (training, export) then sleep at a barrier instead of spinning. Spinning is ~5% faster
    on an idle machine and 1.8x slower beside one busy process (debian-tags; 27x beside another
    training once): a spinning thread takes the core the thread it waits for needs
    (bench/train_threads.py). Set before torch loads libgomp, which reads it once; set
    OMP_WAIT_POLICY=ACTIVE (or GOMP_SPINCOUNT) to spin."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"


class Terminated(KeyboardInterrupt):
    """SIGTERM to an offline command (`timeout`, `docker stop`, a job's deadline), raised where it
    runs as Ctrl-C is, so that what it was writing is cleaned up (staged files, a checkpoint's
    staging folder): Python's default SIGTERM ended the process at once, leaving them."""


# The serving commands stop on SIGTERM their own way (uvicorn's and gunicorn's drains).
_SERVING = ("serve", "serve-ray", "demo")


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    passive_openmp_waits(os.environ)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) \
        if on_main_thread and args.command not in _SERVING else None
    try:
        handler = _import_handler(args.handler)
        return int(handler(args) or 0)
    except (ValueError, OSError) as exc:
        # Input problems (bad data, paths that cannot be read or written) are reported plainly,
        # not as tracebacks; a message of several problems (settings) is one line each.
        message = os_error_message(exc, _path_options(parser, args)) if isinstance(exc, OSError) else str(exc)
        for line in message.splitlines() or [type(exc).__name__]:
            print(f"shortlist {args.command}: error: {line}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"shortlist {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM  # the shell's code for a SIGTERM
    except KeyboardInterrupt:
        # Ctrl-C is the user's own stop, not a failure to debug: one line, the shell's code for
        # SIGINT. What a command writes is staged and renamed at its end: nothing half-made has a final name.
        print(f"shortlist {args.command}: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        # A resource, not an input problem: said plainly, with the limit a user can move.
        print(f"shortlist {args.command}: error: out of memory: this machine's memory (or this process's "
              "limit, `ulimit -v`, a container's memory limit) is not enough for this run", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _import_handler(path: str) -> Any:
    """The command's function ("module:name"), its imports (torch, onnxruntime: seconds) shielded
    from Ctrl-C: a KeyboardInterrupt inside an extension's initialisation surfaced as that
    library's ImportError ("initialization failed"), a traceback; it is raised after them instead."""
    module_name, func_name = path.split(":")
    interrupted: list[type[KeyboardInterrupt]] = []
    # Python runs signal handlers on the main thread only; a SIGINT ignored (a shell's background
    # job) stays ignored. SIGTERM is shielded where main() raises it (offline commands).
    shielded: dict[int, type[KeyboardInterrupt]] = {}
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            shielded[signal.SIGINT] = KeyboardInterrupt
        if signal.getsignal(signal.SIGTERM) is _raise_terminated:
            shielded[signal.SIGTERM] = Terminated
    previous = {s: signal.signal(s, lambda *_, e=e: interrupted.append(e)) for s, e in shielded.items()}
    try:
        module = importlib.import_module(module_name)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if interrupted:
        raise interrupted[0]
    return getattr(module, func_name)


# Errors only a write gets, and the options naming where a command writes.
_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_WRITTEN_OPTIONS = ("--out", "--workdir")


def os_error_message(exc: OSError, options: dict[str, str]) -> str:
    """`--out X: exists and is not a directory`: the option that gave the path (`options`: flag ->
    value, the option whose value is the path or a folder above it), the path and the reason."""
    from service.engine.jsonlines import os_reason

    if exc.filename is None:  # raised by our own code with its own message, or no path (ENOSPC)
        written = [(flag, value) for flag, value in options.items() if flag in _WRITTEN_OPTIONS]
        if exc.errno in _WRITE_ERRORS and written:
            # A write that names no file (the writers name theirs: training.files.naming) wrote
            # below the command's output folder.
            return f"{written[0][0]} {written[0][1]}: {os_reason(exc)}"
        return os_reason(exc)
    path = os.fsdecode(exc.filename)
    reason = os_reason(exc)
    if exc.errno == errno.EEXIST and os.path.lexists(path) and not os.path.isdir(path):
        reason = "exists and is not a directory"
    elif exc.errno == errno.ENOTDIR:
        # `--out FILE/sub`: name the file in the way, not the path that was never there.
        blocker = next((str(p) for p in Path(path).parents if os.path.lexists(p) and not os.path.isdir(p)), None)
        reason = f"{blocker} is not a directory" if blocker is not None else reason
    if exc.filename2 is not None:
        path = f"{path} -> {os.fsdecode(exc.filename2)}"
    flags, value = _options_of(path, options)
    if not flags:
        return f"{path}: {reason}"
    same = os.path.abspath(value) == os.path.abspath(path)
    return f"{', '.join(flags)} {value}: {reason}" if same else f"{', '.join(flags)} {value}: {path}: {reason}"


def _options_of(path: str, options: dict[str, str]) -> tuple[list[str], str]:
    """The options whose value is `path` or the nearest folder above it, else those below it (a
    folder made on the way, `mkdir -p`); several when one path was given twice (`--labels X --out
    X`: which one failed cannot be told apart)."""
    def within(inner: str, outer: str) -> bool:
        inner, outer = os.path.abspath(inner), os.path.abspath(outer)
        return inner == outer or inner.startswith(os.path.join(outer, ""))

    above = [(flag, value) for flag, value in options.items() if within(path, value)]
    if above:
        # Two folders above one path differ in length: the longest is the nearest.
        nearest = max(len(os.path.abspath(value)) for _, value in above)
        above = [(flag, value) for flag, value in above if len(os.path.abspath(value)) == nearest]
        return [flag for flag, _ in above], above[0][1]
    below = [(flag, value) for flag, value in options.items() if within(value, path)]
    return [flag for flag, _ in below], below[0][1] if below else ""


def _path_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Flag -> value of every option of this (sub)command given as a string (the paths among them)."""
    flags: dict[str, str] = {}
    current: argparse.ArgumentParser | None = parser
    while current is not None:
        chosen = None
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(args, action.dest, None) or "")
            elif action.option_strings and isinstance(value := getattr(args, action.dest, None), str) and value:
                flags[action.option_strings[-1]] = value
        current = chosen
    return flags


if __name__ == "__main__":
    sys.exit(main())
