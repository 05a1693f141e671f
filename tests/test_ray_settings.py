"""Settings `shortlist serve-ray` does not apply (service/api/ray_settings.py): refused at start-up,
before Ray starts, naming the variable; left alone at their defaults; and the settings serve-ray
once read from its flags' defaults only (HOST, PORT, STATE_DIR) taken from the environment.

Every test stops the real `main(["serve-ray", ...])` at ray.init (or at the serving step): no
Ray instance is started here."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install '.[ray]')")

import ray  # noqa: E402

from service.api import ray_serve_cli  # noqa: E402
from service.api.ray_app import RayServing, ShardedRegistry, settings_flags  # noqa: E402
from service.api.ray_settings import NOT_APPLIED  # noqa: E402
from service.api.settings import Settings, load_settings, variable_name  # noqa: E402
from shortlist.cli import main  # noqa: E402

# A value other than the default for every setting of NOT_APPLIED.
SET = {"processes": "2", "admin_port": "8001", "max_queued_texts": "9000",
       "max_queue_wait_ms": "500", "bundle_check_interval_s": "5", "load_check_timeout_s": "60",
       "loader_nice": "10", "heap_tuning": "true", "huge_pages": "false", "max_header_bytes": "8192",
       "send_timeout_s": "5", "forwarded_allow_ips": "10.0.0.0/8", "max_connections": "10",
       "header_timeout_s": "3", "body_timeout_s": "7"}
# What some of them need besides, to be valid settings at all.
NEEDS = {"processes": {"SHORTLIST_STATE_DIR": "{tmp}"}}


class RayStarted(Exception):
    """ray.init was reached: nothing refused the settings."""


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.init raises RayStarted, and nothing run_cli sets in the environment outlives the test."""
    def started(*_: Any, **__: Any) -> None:
        raise RayStarted

    monkeypatch.setattr(ray, "init", started)
    monkeypatch.setattr(ray_serve_cli, "haproxy_front", lambda *_: {})
    for name in ("RAY_USAGE_STATS_ENABLED", *ray_serve_cli.LOW_LATENCY_ENV):
        monkeypatch.setenv(name, "0")  # run_cli's setdefault leaves them; monkeypatch restores them


def _serve_ray(root: Path, *flags: str) -> int:
    return main(["serve-ray", "--bundle-root", str(root), "--shards", "1", *flags])


def test_every_unapplied_setting_has_a_value_here():
    assert set(SET) == set(NOT_APPLIED)


@pytest.mark.parametrize("field", [f for f, why in NOT_APPLIED.items() if not why.cluster_only])
def test_a_setting_serve_ray_does_not_apply_stops_it_before_ray(field: str, tmp_path: Path, no_ray: None,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture):
    # A setting read and never applied: an operator who set it believed it held (the quality gate was one).
    monkeypatch.setenv(variable_name(field), SET[field])
    for name, value in NEEDS.get(field, {}).items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    assert _serve_ray(tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"shortlist serve-ray: error: {variable_name(field)}='{SET[field]}': not applied by the "
                   f"sharded service ({NOT_APPLIED[field].reason}): unset it")


@pytest.mark.parametrize("field", [f for f, why in NOT_APPLIED.items() if why.cluster_only])
def test_a_front_limit_is_refused_on_a_cluster_only(field: str, tmp_path: Path, no_ray: None,
                                                    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    monkeypatch.setenv(variable_name(field), SET[field])
    assert _serve_ray(tmp_path, "--address", "auto") == 2
    assert re.fullmatch(f"shortlist serve-ray: error: {variable_name(field)}='{SET[field]}': not applied by the "
                        r"sharded service \(on a cluster \(--address\) .*\): unset it", capsys.readouterr().err.strip())
    with pytest.raises(RayStarted):  # the local instance's HAProxy applies it
        _serve_ray(tmp_path)


def test_every_refusal_is_one_line_each(tmp_path: Path, no_ray: None, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture):
    for field in ("loader_nice", "admin_port"):
        monkeypatch.setenv(variable_name(field), SET[field])
    assert _serve_ray(tmp_path) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split("=")[0] for line in lines] == [f"shortlist serve-ray: error: {variable_name(f)}"
                                                      for f in ("admin_port", "loader_nice")]


@pytest.mark.parametrize("address", [[], ["--address", "auto"]])
def test_unapplied_settings_unset_or_at_their_default_are_not_refused(address: list[str], tmp_path: Path,
                                                                      no_ray: None, monkeypatch: pytest.MonkeyPatch):
    for field in NOT_APPLIED:
        default = Settings.model_fields[field].default
        if default is not None:
            monkeypatch.setenv(variable_name(field), str(default).lower() if isinstance(default, bool) else
                               str(default))
    monkeypatch.setenv("SHORTLIST_ADMIN_PORT", "")  # empty counts as unset
    with pytest.raises(RayStarted):
        _serve_ray(tmp_path, *address)


def test_the_queue_floor_a_large_batch_needs_is_not_refused(tmp_path: Path, no_ray: None,
                                                             monkeypatch: pytest.MonkeyPatch):
    # MAX_BATCH past 4096 is only valid with MAX_QUEUED_TEXTS at least as large.
    monkeypatch.setenv("SHORTLIST_MAX_BATCH", "8192")
    monkeypatch.setenv("SHORTLIST_MAX_EXCLUDE", "0")
    monkeypatch.setenv("SHORTLIST_MAX_QUEUED_TEXTS", "8192")
    with pytest.raises(RayStarted):
        _serve_ray(tmp_path)


def test_host_and_port_come_from_the_environment_without_flags(tmp_path: Path, no_ray: None,
                                                              monkeypatch: pytest.MonkeyPatch):
    # --host and --port had defaults of their own, which always won: SHORTLIST_HOST=0.0.0.0 in a
    # container still listened on loopback.
    served: list[Settings] = []
    monkeypatch.setattr(ray, "init", lambda *_, **__: None)
    monkeypatch.setattr(ray_serve_cli, "_serve_until_stopped",
                        lambda _layout, settings, _front: served.append(settings))
    monkeypatch.setenv("SHORTLIST_HOST", "0.0.0.0")
    monkeypatch.setenv("SHORTLIST_PORT", "8123")
    assert _serve_ray(tmp_path) == 0
    assert (served[-1].host, served[-1].port) == ("0.0.0.0", 8123)
    assert _serve_ray(tmp_path, "--host", "127.0.0.1", "--port", "8124") == 0  # flags win
    assert (served[-1].host, served[-1].port) == ("127.0.0.1", 8124)
    monkeypatch.delenv("SHORTLIST_HOST")
    monkeypatch.delenv("SHORTLIST_PORT")
    assert _serve_ray(tmp_path) == 0
    assert (served[-1].host, served[-1].port) == ("127.0.0.1", 8000)


def test_the_state_dir_of_the_environment_remembers_the_active_version(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    # The registry took the layout's (the flag's) only: SHORTLIST_STATE_DIR was validated, then
    # nothing was remembered across restarts.
    monkeypatch.setenv("SHORTLIST_STATE_DIR", str(tmp_path / "state"))
    layout = RayServing(bundle_root=str(tmp_path), shards=1)
    loop = asyncio.new_event_loop()
    registry = ShardedRegistry(layout, load_settings(settings_flags(layout)), "test", loop)
    try:
        assert registry.remembered is not None and registry.remembered.dir == tmp_path / "state"
    finally:
        registry.close()
        loop.close()


def test_the_readme_names_every_setting_serve_ray_does_not_apply():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("### Past one machine"):readme.index("### Labels that change")]
    missing = [f for f in NOT_APPLIED if f"`{f.upper()}`" not in section]
    assert not missing, missing
