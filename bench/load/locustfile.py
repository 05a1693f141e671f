"""Load on a deployed Shortlist, as its clients send it: mostly single predictions, some batches,
some tree predictions, health checks (`make load URL=...`; or `locust -f bench/load/locustfile.py`).

Texts: the `tst` split titles of the dataset in LOADTEST_DATA (a folder in the raw-text
format, default ../shared/data/debian-deps when present), else the label titles the server
returns for a first query's words, else a few fixed texts. The tree route is used only if the
serving bundle has a tree (a 409 on the first call turns it off for the run).
"""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

from locust import HttpUser, between, constant_throughput, events, task

_DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "debian-deps"
TEXTS: list[str] = []
TREE = {"available": True}


def _load_texts(limit: int = 5000) -> list[str]:
    folder = Path(os.environ.get("LOADTEST_DATA", _DEFAULT_DATA))
    for name in ("tst.json.gz", "tst.json", "tst.jsonl"):
        path = folder / name
        if path.is_file():
            opener = gzip.open if name.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as f:
                texts = [json.loads(line)["title"] for _, line in zip(range(limit), f, strict=False)]
            return [t for t in texts if t.strip()]
    return ["network traffic monitor", "python library for images", "audio player", "text editor",
            "database server", "compression tool", "font for the console", "game engine"]


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    TEXTS.extend(_load_texts())


def _wait_time():
    """LOADTEST_RATE (requests/s per user) paces each user (open-ish loop at a set rate);
    unset, users send back to back (closed loop: the step ramp finds saturation)."""
    rate = float(os.environ.get("LOADTEST_RATE", "0"))
    return constant_throughput(rate) if rate > 0 else between(0, 0)


class ShortlistUser(HttpUser):
    wait_time = _wait_time()

    @task(70)
    def predict(self) -> None:
        self.client.post("/v1/predict", json={"text": random.choice(TEXTS), "k": 10}, name="/v1/predict")

    @task(10)
    def predict_batch(self) -> None:
        self.client.post("/v1/predict", json={"texts": random.sample(TEXTS, 16), "k": 10}, name="/v1/predict [16]")

    @task(15)
    def predict_tree(self) -> None:
        if not TREE["available"]:
            return
        with self.client.post("/v1/predict/tree", json={"text": random.choice(TEXTS), "k": 10},
                              name="/v1/predict/tree", catch_response=True) as r:
            if r.status_code == 409:  # this bundle has no tree: not a failure of the service
                TREE["available"] = False
                r.success()

    @task(5)
    def health(self) -> None:
        self.client.get("/readyz", name="/readyz")
