"""The deployed image, end to end on a real Docker engine (`make container-test`; not in `make test`).

Builds nothing itself: docker/build.sh has made the image (IMAGE, default shortlist:cpu). Trains
two tiny bundles here, then runs the image as users do: bundles mounted read-only, a state
volume, the default non-root user, HEALTHCHECK on readiness.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from model_export.export import export_checkpoint
from service.engine.predictor import Predictor
from shortlist.testing import free_port
from training.config import TrainConfig
from training.data import load_labels
from training.pipeline import train
from training.synthetic import generate

IMAGE = os.environ.get("IMAGE", "shortlist:cpu")
TOKEN = "container-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def docker(*args: str, check: bool = True) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, check=False, timeout=300)
    if check and done.returncode:
        raise RuntimeError(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny bundles (v1, v2) readable by the image's user, and an empty state directory it can write."""
    work = tmp_path_factory.mktemp("container")
    generate(work / "data", num_labels=200, train_docs=1000, test_docs=100, seed=0)
    for version, seed in (("v1", 1), ("v2", 2)):
        ckpt = train(work / "data", TrainConfig.tiny(), seed=seed).save(work / f"ckpt-{version}")
        export_checkpoint(ckpt, work / "bundles", version)
    state = work / "state"
    state.mkdir()
    # The state volume is the image user's to write; the bundles keep the modes export gave
    # them (the image's user, another uid, must be able to read them as they are).
    state.chmod(0o777)
    return {"bundles": work / "bundles", "state": state, "data": work / "data"}


def run_args(volumes: dict[str, Path], env: dict[str, str]) -> list[str]:
    """`docker run` options as users give them: the volumes, and the admin token unless a file gives it."""
    if "SHORTLIST_ADMIN_TOKEN_FILE" not in env:
        env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, **env}
    return ["-v", f"{volumes['bundles']}:/bundles:ro", "-v", f"{volumes['state']}:/state",
            *(arg for key, value in env.items() for arg in ("-e", f"{key}={value}"))]


@contextmanager
def container(volumes: dict[str, Path], *args: str, port: str = "8000", **env: str) -> Iterator[tuple[str, str]]:
    """A running container of IMAGE, healthy (its HEALTHCHECK: /readyz 200): (name, base URL).
    `args`: more `docker run` options; `port`: the one it serves on inside (SHORTLIST_PORT)."""
    name, host_port = f"shortlist-test-{uuid.uuid4().hex[:8]}", free_port()
    docker("run", "-d", "--name", name, "-p", f"127.0.0.1:{host_port}:{port}", *args, *run_args(volumes, env), IMAGE)
    try:
        wait_healthy(name)
        yield name, f"http://127.0.0.1:{host_port}"
    finally:
        print(docker("logs", "--tail", "20", name, check=False))
        docker("rm", "-f", name, check=False)


def wait_healthy(name: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = docker("inspect", "--format", "{{.State.Health.Status}}", name)
        if status == "healthy":
            return
        if docker("inspect", "--format", "{{.State.Running}}", name) != "true":
            raise AssertionError(f"container exited: {docker('logs', name, check=False)[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"not healthy after {timeout:.0f} s: {docker('logs', name, check=False)[-3000:]}")


def test_the_image_runs_as_documented(volumes: dict[str, Path]) -> None:
    assert docker("image", "inspect", "--format", "{{.Config.User}}", IMAGE) not in ("", "0", "root")
    texts = [*load_labels(volumes["data"]).titles[:6], "words no label has"]
    with container(volumes) as (name, url), httpx.Client(base_url=url, timeout=30) as c:
        assert docker("exec", name, "id", "-u") == "10001"
        assert docker("exec", name, "sh", "-c", "touch /bundles/x 2>&1 || echo read-only").endswith("read-only")
        # What the container answers is what the engine answers in-process on the same files.
        local = Predictor.load(volumes["bundles"] / "v2")
        for text in texts:
            body = c.post("/v1/predict", json={"text": text, "k": 5}).json()
            assert body["version"] == "v2"
            ids, scores = local.predict_ids([text], k=5)
            answer = body["results"][0]
            assert [r["id"] for r in answer] == [i for i in ids[0].tolist() if i >= 0]
            assert np.allclose([r["score"] for r in answer], scores[0][: len(answer)], atol=1e-5)
        r = c.post("/admin/bundles/activate", json={"version": "v1"}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert c.post("/v1/predict", json={"text": texts[0]}).json()["version"] == "v1"
        docker("restart", name)
        wait_healthy(name)
        # The activated version survives the restart (the state volume), not the newest bundle.
        assert c.get("/readyz").json()["version"] == "v1"


def _in_flight(url: str) -> float:
    """shortlist_http_requests_in_flight as /metrics reads it (its own request counted)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("shortlist_http_requests_in_flight "))


def test_sigterm_lets_requests_in_flight_finish(volumes: dict[str, Path]) -> None:
    # A request that finds the engine idle waits up to 1 s for company (batching), so the 8 below
    # are in flight together; the signal is sent once the server counts all 8 (and /metrics' own).
    with container(volumes, SHORTLIST_BATCH_MAX_WAIT_MS="1000", SHORTLIST_BATCH_MAX_SIZE="64") as (name, url):
        statuses: list[int | str] = []

        def one(i: int) -> None:
            try:
                statuses.append(httpx.post(f"{url}/v1/predict", json={"text": f"query {i}"}, timeout=30).status_code)
            except httpx.HTTPError as exc:
                statuses.append(repr(exc))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while _in_flight(url) < 9:
            assert time.monotonic() < deadline and any(t.is_alive() for t in threads), statuses
            time.sleep(0.02)
        docker("kill", "--signal", "TERM", name)
        for t in threads:
            t.join()
        assert statuses == [200] * 8, statuses
        deadline = time.monotonic() + 30
        while docker("inspect", "--format", "{{.State.Running}}", name) == "true" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert docker("inspect", "--format", "{{.State.ExitCode}}", name) == "0"


def test_another_port_is_healthy_with_the_token_from_a_secret_file(volumes: dict[str, Path], tmp_path: Path) -> None:
    # Audit s13 G8: the HEALTHCHECK asked port 8000 whatever SHORTLIST_PORT said (never healthy).
    token = "secret-file-token-" + uuid.uuid4().hex
    secret = tmp_path / "admin-token"
    secret.write_text(token + "\n")  # as `openssl rand -hex 32 > admin-token` writes it
    secret.chmod(0o644)  # the image's user reads it
    env = {"SHORTLIST_PORT": "9000", "SHORTLIST_ADMIN_TOKEN_FILE": "/run/secrets/admin-token"}
    with container(volumes, "-v", f"{secret}:/run/secrets/admin-token:ro", port="9000", **env) as (name, url):
        health = docker("inspect", "--format", "{{json .State.Health.Log}}", name)
        assert "ready: http://127.0.0.1:9000/readyz answered 200" in health
        r = httpx.get(f"{url}/admin/bundles", headers={"authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200, r.text


BAD_SETTINGS = [
    ({"SHORTLIST_ADMIN_TOKEN": "x"}, "SHORTLIST_ADMIN_TOKEN is shorter than SHORTLIST_ADMIN_TOKEN_MIN_CHARS=16"),
    ({"SHORTLIST_VERSION": "../x"}, "SHORTLIST_VERSION='../x': invalid bundle version"),
    ({"SHORTLIST_ADMIN_PORT": "8000"}, "SHORTLIST_ADMIN_PORT=8000 equals SHORTLIST_PORT"),
]


@pytest.mark.parametrize(("env", "named"), BAD_SETTINGS, ids=["short-token", "version", "admin-port"])
def test_a_bad_setting_stops_the_container_naming_it(volumes: dict[str, Path], env: dict[str, str],
                                                     named: str) -> None:
    done = subprocess.run(["docker", "run", "--rm", *run_args(volumes, env), IMAGE], capture_output=True,
                          text=True, timeout=120, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("shortlist serve: error: ") and named in lines[0], lines
    assert TOKEN not in done.stderr + done.stdout
