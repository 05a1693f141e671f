"""Labels added live from their text against retraining: hold labels out of training, add them to
the served bundle, compare with the model (and omikuji) retrained with them.

    python bench/live_labels.py --data DIR [--filter own|plain] [--out DIR] [--holdout 0.1]
                                [--config CFG] [--tune | --no-tune] [--scale-labels 100000]

1. A random `holdout` fraction of the labels leaves the data (the label file, every training
   document's targets): the "held-out" model is trained and exported on the rest; the
   "retrained" model on everything, and omikuji (bench/peers.py's peer) on everything.
2. With --tune, the added labels' priors (service.engine.label_changes.LabelEditor's
   prior_quantile and lexical_quantile) are chosen on validation documents: the training
   documents training itself held out for validation (training.dataset.TrainingSet's split,
   reproduced from the held-out checkpoint's seed; neither model trained on them), scored
   against their held-out labels and all the others; the objective is overall P@1 + P@5 +
   recall@10 on the held-out labels. The test split is never looked at.
3. Live: a real server serves the held-out model; under load (closed-loop clients), the
   held-out labels are added by their text in `batches` POST /admin/labels calls, then
   `retire_batches` batches of labels are retired. Failed requests, latency before and during
   the changes, each change's time; retired labels are checked absent from every answer, and a
   restart must serve the same version and the same answers.
4. On the test documents (debian-deps: the filtered protocol, each document's own label left
   out, and plain; as --filter says), P@1, P@5, recall@10 overall and P@5 / recall@10 on the
   held-out labels, for the held-out model, the live-added one (the bundle the server wrote,
   through the engine), the retrained model and omikuji.
With --scale-labels N, also: the held-out bundle is grown to N labels by adding texts (other
documents' titles), and the time to add 1,000 labels to it through the API is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _common import (
    BENCH_DIR,
    OUT_DIR,
    command_line,
    git_revision,
    latency_summary,
    read_jsonl,
    replace_section,
    write_jsonl_gz,
)

from service.engine import Predictor, PredictorOptions
from service.engine.bundle import Bundle
from service.engine.label_changes import LabelChange, LabelEditor, NewLabel
from service.engine.lexical import TokenShortlist
from shortlist.testing import serve

TOKEN = "bench-live-labels"
AUTH = {"authorization": f"Bearer {TOKEN}"}
RANKED = 11  # top 10 after leaving a document's own label out


def holdout_dataset(data_dir: Path, out_dir: Path, fraction: float, seed: int) -> list[str]:
    """Write data_dir without a random `fraction` of its labels to out_dir; returns their uids.

    The held-out labels leave the label file (so neither their text nor their rows reach
    training) and every training document's targets; test targets are remapped the same way
    (the held-out model's own test report then covers the labels it knows). Documents are kept,
    even those left with no label: their words still shape the vocabulary, as they would for a
    model trained before the labels existed.
    """
    from training.data import find_split_file

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = read_jsonl(find_split_file(data_dir, "lbl"))
    held = held_out_mask(len(labels), fraction, seed)
    new_row = np.cumsum(~held) - 1
    write_jsonl_gz(out_dir / "lbl.json.gz", [row for row, h in zip(labels, held, strict=True) if not h])
    for split in ("trn", "tst"):
        rows = []
        for doc in read_jsonl(find_split_file(data_dir, split)):
            keep = [i for i, t in enumerate(doc["target_ind"]) if not held[t]]
            doc = dict(doc, target_ind=[int(new_row[doc["target_ind"][i]]) for i in keep])
            if "target_rel" in doc:
                doc["target_rel"] = [doc["target_rel"][i] for i in keep]
            rows.append(doc)
        write_jsonl_gz(out_dir / f"{split}.json.gz", rows)
    uids = [str(labels[i]["uid"]) for i in np.flatnonzero(held)]
    (out_dir / "holdout.json").write_text(json.dumps(uids), encoding="utf-8")
    return uids


def held_out_mask(num_labels: int, fraction: float, seed: int) -> np.ndarray:
    """The labels a draw holds out: a random `fraction` of them, seeded."""
    held = np.zeros(num_labels, dtype=bool)
    held[np.random.default_rng(seed).choice(num_labels, size=round(fraction * num_labels), replace=False)] = True
    return held


def trained_bundle(data_dir: Path, out: Path, name: str, config: str | None, seed: int) -> Path:
    """out/bundles/NAME: trained on data_dir and exported (reused when it exists)."""
    bundle = out / "bundles" / name
    if (bundle / "manifest.json").is_file():
        return bundle
    cli = [sys.executable, "-m", "shortlist.cli"]
    ckpt = out / f"ckpt-{name}"
    log = (out / f"train-{name}.log").open("a")
    if not (ckpt / "checkpoint.json").exists():
        cmd = [*cli, "train", "--data", str(data_dir), "--out", str(ckpt), "--seed", str(seed)]
        subprocess.run(cmd + (["--config", config] if config else []), check=True, stdout=log, stderr=log)
    subprocess.run([*cli, "export", str(ckpt), "--out", str(out / "bundles"), "--version", name], check=True,
                   stdout=log, stderr=log)
    return bundle


class Truth:
    """The full dataset's labels and test (or validation) documents, label ids in the full label file."""

    def __init__(self, data_dir: Path, held_uids: Sequence[str], docs: list[dict[str, Any]],
                 aliases: dict[str, str] | None = None) -> None:
        from training.data import find_split_file

        self.label_uids = [str(r["uid"]) for r in read_jsonl(find_split_file(data_dir, "lbl"))]
        self.index = {uid: i for i, uid in enumerate(self.label_uids)}
        # A bundle's uid -> the dataset's (a label added again under another uid is the same label).
        self.index.update({alias: self.index[uid] for alias, uid in (aliases or {}).items()})
        self.held = np.zeros(len(self.label_uids), dtype=bool)
        self.held[[self.index[u] for u in held_uids]] = True
        self.texts = [d["title"] for d in docs]
        self.targets = [list(dict.fromkeys(d["target_ind"])) for d in docs]
        self.own = np.array([self.index.get(str(d["uid"]), -1) for d in docs], dtype=np.int64)

    def to_full(self, bundle_uids: Sequence[str], ids: np.ndarray) -> np.ndarray:
        table = np.array([self.index.get(u, -1) for u in bundle_uids] + [-1], dtype=np.int64)
        return table[np.where(ids >= 0, ids, len(bundle_uids))]

    def metrics(self, preds: np.ndarray, own_excluded: bool) -> dict[str, float]:
        """P@1, P@5, recall@10 overall; P@5 and recall@10 on the held-out labels (over the documents
        that have one), in percent; with own_excluded each document's own label leaves both sides."""
        sums = {"P@1": 0.0, "P@5": 0.0, "R@10": 0.0, "held P@5": 0.0, "held R@10": 0.0}
        docs = held_docs = 0
        per_label: dict[int, list[int]] = {}  # held-out label -> [documents it is in the top 10 of, documents]
        for row, truth, own in zip(preds, self.targets, self.own, strict=True):
            if own_excluded and own >= 0:
                row, truth = row[row != own], [t for t in truth if t != own]
            row = row[:10]
            if not truth:
                continue
            hits = np.isin(row, truth)
            docs += 1
            sums["P@1"] += hits[:1].sum()
            sums["P@5"] += hits[:5].sum() / 5
            sums["R@10"] += hits.sum() / len(truth)
            held = [t for t in truth if self.held[t]]
            if held:
                held_docs += 1
                held_hits = np.isin(row, held)
                sums["held P@5"] += held_hits[:5].sum() / 5
                sums["held R@10"] += held_hits.sum() / len(held)
                for t in held:
                    counts = per_label.setdefault(t, [0, 0])
                    counts[0] += int(t in row)
                    counts[1] += 1
        out = {k: 100 * v / max(docs, 1) for k, v in sums.items() if not k.startswith("held")}
        out.update({k: 100 * v / max(held_docs, 1) for k, v in sums.items() if k.startswith("held")})
        # The document average weighs a held-out label by its documents: the label average beside it.
        out["held R@10 labels"] = 100 * float(np.mean([a / b for a, b in per_label.values()])) if per_label else 0.0
        top = max(per_label, key=lambda t: per_label[t][1]) if per_label else -1
        out.update(docs=docs, held_docs=held_docs, held_labels=len(per_label),
                   top_held={"uid": self.label_uids[top], "found": per_label[top][0], "docs": per_label[top][1]}
                   if per_label else None)
        return out


def bundle_predictions(bundle_dir: Path, truth: Truth, options: PredictorOptions | None = None,
                       exact: bool = False, without_overflow: bool = False) -> np.ndarray:
    """Top RANKED of every document, through the engine on the bundle's files, as full label ids.

    exact: every label scored (no shortlist); without_overflow: the token table served without
    its overflow rows (the added labels' slots), an ablation only this bench makes."""
    predictor = Predictor.load(bundle_dir, options)
    if without_overflow and predictor.sources.table is not None:
        t = predictor.sources.table
        predictor.sources.table = TokenShortlist(t.labels, t.weights, t.form, t.bias)
    predict = predictor.predict_exact_ids if exact else predictor.predict_ids
    try:
        ids = np.vstack([predict(truth.texts[i : i + 500], k=RANKED)[0] for i in range(0, len(truth.texts), 500)])
        return truth.to_full(predictor.bundle.labels.uids, ids)
    finally:
        predictor.bundle.close()


def ablations(holdout: Path, live_dir: Path, added: list[NewLabel], hints: dict[str, float], truth: Truth,
              scratch: Path) -> dict[str, Any]:
    """The live bundle's predictions with one of its ways of placing the added labels taken away,
    with exact scoring of every label (the ceiling of any shortlist), and the same labels added
    (offline, the service's editor) with prior hints."""
    preds = {"live exact": bundle_predictions(live_dir, truth, exact=True),
             "live without added search": bundle_predictions(live_dir, truth, PredictorOptions(k_added=0)),
             "live without overflow": bundle_predictions(live_dir, truth, without_overflow=True)}
    parent = Bundle.open(holdout)
    try:
        hinted = [dataclasses.replace(a, prior=hints[a.uid]) for a in added]
        shutil.rmtree(scratch, ignore_errors=True)
        LabelEditor().derive(parent, LabelChange(add=hinted), scratch, "hinted")
    finally:
        parent.close()
    preds["live with prior hints"] = bundle_predictions(scratch / "hinted", truth)
    preds["live with prior hints, exact"] = bundle_predictions(scratch / "hinted", truth, exact=True)
    preds["live with prior hints, k_added 50"] = bundle_predictions(scratch / "hinted", truth,
                                                                   PredictorOptions(k_added=50))
    shutil.rmtree(scratch, ignore_errors=True)
    return preds


def omikuji_predictions(data_dir: Path, out: Path, truth: Truth, seed: int) -> np.ndarray:
    """omikuji (bench/peers.py's peer, default hyper-parameters) trained on the full data."""
    cached = out / "omikuji-preds.npy"
    if cached.exists():
        return np.load(cached)
    import peers

    args = argparse.Namespace(data=str(data_dir), limit=None, out=str(out / "omikuji"), text_field="title",
                              min_df=1, max_vocab=200_000, max_tokens=64)
    files, _, _ = peers.prepare_run(args)
    peer = peers.OmikujiPeer(files)
    model_dir = files.models / "omikuji"
    if not (model_dir / "settings.json").exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        peer.train(model_dir, threads=2, seed=seed)
    peer.load(model_dir)
    preds = peers._pad_ids([peer.predict_one(t, RANKED) for t in truth.texts], RANKED)
    np.save(cached, preds)
    return preds


def new_labels(data_dir: Path, uids: Sequence[str], priors: dict[str, float] | None = None) -> list[NewLabel]:
    from training.data import find_split_file

    rows = {str(r["uid"]): r for r in read_jsonl(find_split_file(data_dir, "lbl"))}
    return [NewLabel(uid, rows[uid]["title"], rows[uid].get("content"), (priors or {}).get(uid)) for uid in uids]


def prior_hints(data_dir: Path, held_uids: Sequence[str]) -> dict[str, float]:
    """What a user who knows how common each new label is would say (NewLabel.prior): where its
    number of training documents ranks among the trained labels' (a quantile). Not text: the
    bench reads it from the full training split, which the held-out model never saw."""
    from training.data import find_split_file

    uids = [str(r["uid"]) for r in read_jsonl(find_split_file(data_dir, "lbl"))]
    counts = np.zeros(len(uids))
    for doc in read_jsonl(find_split_file(data_dir, "trn")):
        counts[list(set(doc["target_ind"]))] += 1
    held = np.isin(uids, list(held_uids))
    trained = np.sort(counts[~held])
    ranks = np.searchsorted(trained, counts[held], side="right") / len(trained)
    return {uid: float(q) for uid, q in zip(np.asarray(uids)[held], ranks, strict=True)}


def validation_documents(trn: list[dict[str, Any]], checkpoint: Path) -> list[dict[str, Any]]:
    """The training documents a training run with the checkpoint's config held out for
    validation (training.dataset.TrainingSet.load: the first draw of default_rng(seed))."""
    cfg = json.loads((checkpoint / "checkpoint.json").read_text(encoding="utf-8"))["config"]
    n_val = min(cfg["val_max_docs"], max(1, int(len(trn) * cfg["val_fraction"])))
    perm = np.random.default_rng(cfg["seed"]).permutation(len(trn))
    return [trn[i] for i in sorted(perm[:n_val].tolist())]


def tune_priors(holdout: Path, added: list[NewLabel], val: Truth, own_excluded: bool, scratch: Path,
                grid: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each LabelEditor setting of the grid: the held-out bundle with the labels added that way,
    scored on validation documents; best objective first."""
    rows = []
    parent = Bundle.open(holdout)
    try:
        for setting in grid:
            shutil.rmtree(scratch, ignore_errors=True)
            t0 = time.perf_counter()
            editor = {k: v for k, v in setting.items() if k != "prior_hints"}
            labels = added if setting.get("prior_hints", True) else [dataclasses.replace(a, prior=None) for a in added]
            LabelEditor(**editor).derive(parent, LabelChange(add=labels), scratch, "tune")
            m = val.metrics(bundle_predictions(scratch / "tune", val), own_excluded)
            objective = m["P@1"] + m["P@5"] + m["held R@10"]
            rows.append({"editor": setting, "objective": objective, **m, "derive_s": time.perf_counter() - t0})
            print(f"[tune] {setting}: objective {objective:.2f} P@1 {m['P@1']:.2f} P@5 {m['P@5']:.2f} "
                  f"held R@10 {m['held R@10']:.2f}", flush=True)
    finally:
        parent.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return sorted(rows, key=lambda r: -r["objective"])


def editor_grid(spec: str) -> list[dict[str, Any]]:
    """Every combination of a JSON {LabelEditor argument: [values]} (null: the argument's "off")."""
    axes = json.loads(spec)
    grid: list[dict[str, Any]] = [{}]
    for name, values in axes.items():
        grid = [{**g, name: v} for g in grid for v in values]
    return grid


class Load:
    """Closed-loop clients posting /v1/predict (and every third request /v1/predict/tree); each
    answer's time, status and labels kept with its start time."""

    def __init__(self, url: str, texts: Sequence[str], clients: int) -> None:
        self.url, self.texts = url, texts
        self.records: list[tuple[float, float, int, list[str]]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, clients), daemon=True) for i in range(clients)]

    def _run(self, first: int, step: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            i = first
            while not self._stop.is_set():
                path = "/v1/predict/tree" if i % 3 == 2 else "/v1/predict"
                t0 = time.perf_counter()
                try:
                    r = c.post(path, json={"text": self.texts[i % len(self.texts)], "k": 10})
                    uids = [x["uid"] for x in r.json()["results"][0]] if r.status_code == 200 else []
                    status = r.status_code
                except (httpx.HTTPError, ValueError):
                    uids, status = [], 0
                self.records.append((t0, time.perf_counter() - t0, status, uids))
                i += step

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def between(self, start: float, end: float) -> list[tuple[float, float, int, list[str]]]:
        return [r for r in self.records if start <= r[0] < end]


def _phase(records: list[tuple[float, float, int, list[str]]]) -> dict[str, Any]:
    ok = [r[1] for r in records if r[2] == 200]
    return {"requests": len(records), "failed": len(records) - len(ok), **(latency_summary(ok) if ok else {})}


def live_run(out: Path, held: list[NewLabel], retire_pool: list[str], texts: Sequence[str], batches: int,
             retire_batches: int, clients: int, steady_s: float) -> dict[str, Any]:
    """The held-out bundle served; labels added and retired under load; a restart. Returns the
    figures and the version that held every added label (before the retirements)."""
    state = out / "state-live"
    shutil.rmtree(state, ignore_errors=True)
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state)}
    changes: list[dict[str, Any]] = []
    probe = [lab.title for lab in held[:: max(1, len(held) // 200)]][:200] + list(texts[:100])
    with serve(out / "bundles", version="holdout", env=env, log_dir=out, timeout=900) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=900) as admin, Load(s.url, texts, clients) as load:
        time.sleep(steady_s)
        changes_start = time.perf_counter()
        for i, part in enumerate(np.array_split(np.arange(len(held)), batches)):
            body = {"labels": [{"uid": held[j].uid, "title": held[j].title} for j in part]}
            changes.append(_timed(admin.post, "/admin/labels", json=body) | {"kind": "add", "labels": len(part)})
            print(f"[live] add batch {i + 1}/{batches}: {changes[-1]}", flush=True)
        all_added = changes[-1]["version"]
        retired: list[str] = []
        for i, part in enumerate(np.array_split(np.array(retire_pool), retire_batches)):
            retired += part.tolist()
            changes.append(_timed(admin.post, "/admin/labels/retire", json={"uids": part.tolist()})
                           | {"kind": "retire", "labels": len(part)})
            print(f"[live] retire batch {i + 1}/{retire_batches}: {changes[-1]}", flush=True)
        changes_end = time.perf_counter()
        time.sleep(steady_s)
        after_end = time.perf_counter()
        answers = _answers(admin, probe)
    returned = {uid for rec in load.between(changes_end, after_end) for uid in rec[3]}
    returned |= {uid for row in answers["alpha"] + answers["tree"] for uid in row}
    with serve(out / "bundles", version="holdout", env=env, log_dir=out, timeout=900) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=900) as admin:
        restarted = _answers(admin, probe)
    return {
        "steady": _phase(load.between(0, changes_start)),
        "during_changes": _phase(load.between(changes_start, changes_end)),
        "after": _phase(load.between(changes_end, after_end)),
        "changes": changes, "all_added_version": all_added,
        "retired_returned": len(set(retired) & returned),
        "restart_same_version": restarted["version"] == answers["version"],
        "restart_same_answers": restarted["alpha"] == answers["alpha"] and restarted["tree"] == answers["tree"],
        "failed_requests": sum(1 for r in load.records if r[2] != 200),
    }


def _timed(call: Any, path: str, **kwargs: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = call(path, **kwargs)
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text[:500]}")
    body = r.json()
    return {"version": body["active"], "wall_s": wall, "derive_s": body["derive_seconds"], "server_s": body["seconds"]}


def _answers(client: httpx.Client, texts: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, path in (("alpha", "/v1/predict"), ("tree", "/v1/predict/tree")):
        rows = []
        for i in range(0, len(texts), 100):
            r = client.post(path, json={"texts": list(texts[i : i + 100]), "k": 10})
            r.raise_for_status()
            rows += [[x["uid"] for x in row] for row in r.json()["results"]]
            out["version"] = r.json()["version"]
        out[name] = rows
    return out


def scale_run(out: Path, data_dir: Path, target: int) -> dict[str, Any]:
    """The held-out bundle grown to `target` labels (texts: the dataset's document titles), then
    1,000 more labels added through the API: the time a user waits."""
    root = out / "scale"
    if not (root / "big").exists():
        parent = Bundle.open(out / "bundles" / "holdout")
        from training.data import find_split_file

        titles = [r["title"] for split in ("trn", "tst") for r in read_jsonl(find_split_file(data_dir, split))]
        needed = target - len(parent.labels)
        fill = [NewLabel(f"scale-{i}", titles[i % len(titles)]) for i in range(needed)]
        fill = [lab for lab in fill if parent.tokenizer.encode(lab.title)[0]]
        t0 = time.perf_counter()
        LabelEditor().derive(parent, LabelChange(add=fill), root, "big")
        print(f"[scale] grew to {len(parent.labels) + len(fill)} labels in {time.perf_counter() - t0:.1f}s", flush=True)
        parent.close()
    big = Bundle.open(root / "big")
    num_labels = big.manifest.num_labels
    # 1,000 texts the vocabulary can place: test document titles, from the end (the fill took the first ones).
    from training.data import find_split_file

    titles = [r["title"] for r in read_jsonl(find_split_file(data_dir, "tst"))][::-1]
    extra = [{"uid": f"scale-extra-{i}", "title": t} for i, t in enumerate(
        t for t in titles if big.tokenizer.encode(t)[0])][:1000]
    big.close()
    state = out / "state-scale"
    shutil.rmtree(state, ignore_errors=True)
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state)}
    with serve(root, version="big", env=env, log_dir=out, timeout=900) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=900) as admin:
        timed = _timed(admin.post, "/admin/labels", json={"labels": extra})
    return {"labels_before": num_labels, "added": len(extra), **timed}


# "prior_hints": whether the labels are added with NewLabel.prior (prior_hints()), not an editor setting.
DEFAULT_GRID = {"prior_hints": [False], "prior_quantile": [0.9, 0.95, 0.99], "added_shortlist": [0, 50, 200]}
SYSTEMS = (("held-out", "the model that never saw them"), ("live", "held-out model + labels added live"),
           ("retrained", "Shortlist retrained with them"), ("omikuji", "omikuji retrained with them"),
           ("live exact", "live, every label scored (no shortlist)"),
           ("live without added search", "live, k_added 0 (added labels reach a query by their words only)"),
           ("live without overflow", "live, no token overflow (added labels reach a query by search only)"),
           ("live with prior hints", "added with how common each is (NewLabel.prior; not text: see below)"),
           ("live with prior hints, exact", "the same, every label scored"))
METRICS = ("P@1", "P@5", "R@10", "held P@5", "held R@10", "held R@10 labels")


def render(result: dict[str, Any]) -> str:
    a = result["args"]
    out = [f"### Labels added live: {a['dataset']} ({a['held_out']} of {a['labels']} labels held out)", "",
           f"Command: `{result['command']}` (commit {result['commit']}, {result['date']}; other agents shared "
           "the 2-core CPU).", ""]
    for protocol, rows in result["metrics"].items():
        out += [f"Test documents, {protocol} ({rows['held-out']['docs']} documents with labels, "
                f"{rows['held-out']['held_docs']} of them with a held-out label; held: only the held-out labels "
                "count as hits):", "", "| system | " + " | ".join(METRICS) + " |", "|---|" + "---|" * len(METRICS)]
        out += [f"| {name}: {what} | " + " | ".join(f"{rows[name][m]:.2f}" for m in METRICS) + " |"
                for name, what in SYSTEMS if name in rows]
        live, re_ = rows["live"], rows["retrained"]
        top = re_["top_held"]
        found = ", ".join(f"{rows[n]['top_held']['found']} ({n})" for n, _ in SYSTEMS if n in rows)
        out += ["", f"Live-added labels' recall@10 is {100 * live['held R@10'] / max(re_['held R@10'], 1e-9):.1f}% of "
                f"the retrained model's (bar >= 50%); overall P@1 {live['P@1'] - rows['held-out']['P@1']:+.2f} points "
                "against the model that never saw them (bar: within 1). held R@10 labels: the same recall averaged "
                f"over the {re_['held_labels']} held-out labels instead of the documents. The most frequent held-out "
                f"label, {top['uid']}, is a target of {top['docs']} of the {re_['held_docs']} documents with a "
                f"held-out label; in the top 10 of {found}.", ""]
    tune = result.get("tuning")
    if tune:
        names = list(tune[0]["editor"])
        out += [f"LabelEditor settings chosen on validation documents ({tune[0]['docs']} training documents no "
                "model trained on, scored against every label; objective P@1 + P@5 + held-out recall@10; best "
                "first):", "", "| " + " | ".join(names) + " | objective | P@1 | P@5 | held R@10 | held R@10 labels |",
                "|---" * (len(names) + 5) + "|"]
        out += ["| " + " | ".join(str(r["editor"][n]) for n in names) + f" | {r['objective']:.2f} | {r['P@1']:.2f} | "
                f"{r['P@5']:.2f} | {r['held R@10']:.2f} | {r['held R@10 labels']:.2f} |" for r in tune]
        out.append("")
    live = result["live"]
    adds = [c for c in live["changes"] if c["kind"] == "add"]
    out += [f"Live, {a['clients']} closed-loop clients (/v1/predict, every third /v1/predict/tree): "
            f"{len(adds)} batches adding {sum(c['labels'] for c in adds)} labels, then "
            f"{len(live['changes']) - len(adds)} batches retiring {a['retired']} labels; each a new version activated "
            f"as any other (checked in a child process first). Failed requests: {live['failed_requests']}. "
            f"Retired labels returned after their retirement: {live['retired_returned']}. After a restart: same "
            f"version {live['restart_same_version']}, same answers {live['restart_same_answers']}.", "",
            "| phase | requests | failed | p50 (ms) | p99 (ms) |", "|---|---|---|---|---|"]
    for phase in ("steady", "during_changes", "after"):
        p = live[phase]
        out.append(f"| {phase} | {p['requests']} | {p['failed']} | {p.get('p50_ms', 0):.2f} "
                   f"| {p.get('p99_ms', 0):.2f} |")
    out += ["", "Each change (wall: the admin request; derive: writing the bundle; the rest is the child-process "
            "check, the load and the swap): " + ", ".join(
                f"{c['kind']} {c['labels']}: {c['wall_s']:.1f} s (derive {c['derive_s']:.1f})" for c in live["changes"])
            + "."]
    if result.get("scale"):
        sc = result["scale"]
        out += ["", f"Adding {sc['added']} labels to a {sc['labels_before']}-label bundle through the API: "
                f"{sc['wall_s']:.1f} s (derive {sc['derive_s']:.1f} s)."]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", default=None, help="run folder (default bench/out/live-<dataset>)")
    p.add_argument("--filter", default="plain", choices=["plain", "own"],
                   help="own: also score with each document's own label left out (debian-deps)")
    p.add_argument("--holdout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=None, help="training config (bench/tags-config.json for debian-tags)")
    p.add_argument("--tune", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--grid", default=json.dumps(DEFAULT_GRID),
                   help="with --tune: JSON {LabelEditor argument: [values]}, every combination scored")
    p.add_argument("--tune-only", action="store_true", help="stop after --tune (validation documents only)")
    p.add_argument("--retrained", default=None,
                   help="a bundle trained on the full data with the same config and seed (else trained here)")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--retire-batches", type=int, default=5)
    p.add_argument("--retire", type=int, default=100, help="labels retired in all (trained, not held-out ones)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--steady-s", type=float, default=10.0)
    p.add_argument("--scale-labels", type=int, default=0)
    p.add_argument("--ablations", action=argparse.BooleanOptionalAction, default=True,
                   help="also score the live bundle exactly and without each way of placing added labels")
    p.add_argument("--publish", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    data = Path(args.data).resolve()
    out = Path(args.out or OUT_DIR / f"live-{data.name}").resolve()
    held_uids = (json.loads((out / "data-holdout" / "holdout.json").read_text())
                 if (out / "data-holdout" / "holdout.json").exists()
                 else holdout_dataset(data, out / "data-holdout", args.holdout, args.seed))
    holdout = trained_bundle(out / "data-holdout", out, "holdout", args.config, args.seed)
    full = Path(args.retrained).resolve() if args.retrained else trained_bundle(data, out, "full", args.config,
                                                                                   args.seed)
    hints = prior_hints(data, held_uids)
    added = new_labels(data, held_uids)
    from training.data import find_split_file

    rng = np.random.default_rng(args.seed)
    trn = read_jsonl(find_split_file(data, "trn"))
    tst = read_jsonl(find_split_file(data, "tst"))
    protocols = {"plain": False, **({"own label excluded": True} if args.filter == "own" else {})}
    result: dict[str, Any] = {"command": command_line(), "commit": git_revision(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.tune:
        val = Truth(data, held_uids, validation_documents(trn, out / "ckpt-holdout"))
        result["tuning"] = tune_priors(holdout, new_labels(data, held_uids, hints), val, args.filter == "own",
                                       out / "tune-scratch", editor_grid(args.grid))
        if args.tune_only:
            print(json.dumps(result["tuning"], indent=1, default=str))
            return 0
    truth = Truth(data, held_uids, tst)
    held_set = set(held_uids)
    trained_uids = [u for u in Bundle.open(holdout).labels.uids if u not in held_set]
    retire_pool = [trained_uids[int(i)] for i in rng.choice(len(trained_uids), args.retire, replace=False)]
    texts = [d["title"] for d in tst if d["title"].strip()][:5000]
    result["live"] = live_run(out, added, retire_pool, texts, args.batches, args.retire_batches, args.clients,
                              args.steady_s)
    live_dir = out / "state-live" / "bundles" / result["live"]["all_added_version"]
    preds = {"held-out": bundle_predictions(holdout, truth), "live": bundle_predictions(live_dir, truth),
             "retrained": bundle_predictions(full, truth), "omikuji": omikuji_predictions(data, out, truth, args.seed)}
    if args.ablations:
        preds.update(ablations(holdout, live_dir, added, hints, truth, out / "ablation-scratch"))
    result["metrics"] = {name: {s: truth.metrics(pr, excluded) for s, pr in preds.items()}
                         for name, excluded in protocols.items()}
    if args.scale_labels:
        result["scale"] = scale_run(out, data, args.scale_labels)
    result["args"] = {**vars(args), "dataset": data.name, "held_out": len(held_uids),
                      "labels": len(truth.label_uids), "retired": args.retire}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    table = render(result)
    print(table)
    if args.publish:
        replace_section(BENCH_DIR / "RESULTS.md", f"live-labels:{data.name}", table)
    return 0 if result["live"]["failed_requests"] == 0 and not result["live"]["retired_returned"] else 1


if __name__ == "__main__":
    sys.exit(main())
