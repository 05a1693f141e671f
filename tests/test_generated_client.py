"""A client generated from a live server's /openapi.json, as a user makes one (openapi-python-client),
calls every operation with the typed models the schema gives it and reads every answer, errors
included, as the models the schema documents."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from shortlist.testing import serve

TOKEN = "generated-client-admin-token"
MAX_K = 20


def _generate(spec: dict, out: Path) -> Path:
    """The client package's parent directory, generated from `spec` as its README says."""
    (out / "openapi.json").write_text(json.dumps(spec), encoding="utf-8")
    bin_dir = Path(sys.executable).parent  # ruff, which the generator formats its output with
    done = subprocess.run([str(bin_dir / "openapi-python-client"), "generate", "--path", "openapi.json",
                           "--output-path", "client"], cwd=out, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])})
    # A piece the generator could not model is skipped with a warning, not an error.
    assert done.returncode == 0 and "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    return out / "client"


def test_a_generated_client_calls_every_operation_with_typed_models(bundle_root_copy, tmp_path, monkeypatch):
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(tmp_path / "state"),
           "SHORTLIST_MAX_K": str(MAX_K), "SHORTLIST_ACCESS_LOG": "false"}
    title = json.loads((bundle_root_copy / "v2" / "labels.jsonl").read_text(encoding="utf-8").splitlines()[0])["title"]
    with serve(bundle_root_copy, env=env, log_dir=tmp_path) as server:
        spec = httpx.get(f"{server.url}/openapi.json").json()
        monkeypatch.syspath_prepend(str(_generate(spec, tmp_path)))
        client = importlib.import_module("shortlist_client")
        models = importlib.import_module("shortlist_client.models")
        api = {name: importlib.import_module(f"shortlist_client.api.{group}.{name}")
               for group in ("default", "admin") for name in _modules(tmp_path / "client", group)}
        operations = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
        assert len(api) == len(operations), sorted(api)  # a module per operation
        anyone = client.Client(base_url=server.url, raise_on_unexpected_status=True)
        admin = client.AuthenticatedClient(base_url=server.url, token=TOKEN, raise_on_unexpected_status=True)
        _predict(api, models, anyone)
        _admin(api, models, anyone, admin, title)


def _modules(root: Path, group: str) -> list[str]:
    return [p.stem for p in (root / "shortlist_client" / "api" / group).glob("*.py") if p.stem != "__init__"]


def _call(api: dict, prefix: str, **kwargs):
    (name,) = [n for n in api if n.startswith(prefix)]
    return api[name].sync(**kwargs)


def _predict(api: dict, models, anyone) -> None:
    one = _call(api, "predict_v1", client=anyone, body=models.PredictRequestOne(text="network monitor", k=3))
    assert isinstance(one, models.PredictResponse) and one.version == "v2" and len(one.results[0]) == 3
    batch = _call(api, "predict_v1", client=anyone, body=models.PredictRequestBatch(texts=["a b", "c d"], k=2))
    assert isinstance(batch, models.PredictResponse) and [len(r) for r in batch.results] == [2, 2]
    tree = _call(api, "predict_tree", client=anyone, body=models.TreePredictRequestOne(text="network monitor", k=2))
    assert isinstance(tree, models.PredictResponse) and len(tree.results[0]) == 2
    refused = _call(api, "predict_v1", client=anyone, body=models.PredictRequestOne(text="x", k=MAX_K + 1))
    assert isinstance(refused, models.ErrorResponse) and refused.error == "invalid_request"
    assert [d.field for d in refused.details] == ["body.k"]
    assert _call(api, "readyz", client=anyone).status == "ready"
    assert _call(api, "healthz", client=anyone).version == "v2"
    metrics = api[next(n for n in api if n.startswith("metrics"))].sync_detailed(client=anyone)
    assert metrics.status_code == 200 and b"shortlist_" in metrics.content


def _admin(api: dict, models, anyone, admin, title: str) -> None:
    listed = _call(api, "bundles", client=admin)
    assert isinstance(listed, models.BundleList) and [b.version for b in listed.bundles] == ["v1", "v2"]
    assert _call(api, "bundles", client=anyone).error == "unauthorized"
    assert _call(api, "activate", client=admin, body=models.ActivateRequest(version="v1")).active == "v1"
    assert _call(api, "activate", client=admin, body=models.ActivateRequest(version="v9")).error == "bundle_not_found"
    assert _call(api, "rollback", client=admin).active == "v2"  # no body: the one a client sends most
    stale = _call(api, "rollback", client=admin, body=models.RollbackRequest(expected_active="v1"))
    assert isinstance(stale, models.ErrorResponse) and stale.error == "active_version_changed"
    added = _call(api, "add_labels", client=admin,
                  body=models.AddLabelsRequest(labels=[models.NewLabel(uid="made/by-client", title=title)]))
    assert isinstance(added, models.LabelChangeResult) and added.added == 1 and added.previous == "v2"
    found = _call(api, "label_admin", client=admin, uid="made/by-client")
    assert isinstance(found, models.LabelInfo) and not found.retired and found.version == added.active
    retired = _call(api, "retire_label_", client=admin, uid="made/by-client")
    assert isinstance(retired, models.LabelChangeResult) and retired.retired == 1
    again = _call(api, "retire_label_", client=admin, uid="made/by-client")
    assert isinstance(again, models.ErrorResponse) and again.error == "label_not_found"
    unknown = _call(api, "retire_labels", client=admin, body=models.RetireLabelsRequest(uids=["no-such-uid"]))
    assert isinstance(unknown, models.ErrorResponse) and unknown.details[0].field == "body.uids[0]"
