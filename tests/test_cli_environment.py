"""The environment the `shortlist` command sets for the libraries it loads."""

from __future__ import annotations

import os
import subprocess
import sys

from shortlist.cli import passive_openmp_waits


def test_openmp_threads_sleep_at_barriers_unless_the_user_says_otherwise() -> None:
    """OMP_WAIT_POLICY=PASSIVE by default (bench/train_threads.py: spinning threads made training
    1.8x slower beside one busy process); a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept."""
    for given, expected in (({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                            ({"GOMP_SPINCOUNT": "300000"}, None)):
        env = dict(given)
        passive_openmp_waits(env)
        assert env.get("OMP_WAIT_POLICY") == expected and {k: env[k] for k in given} == given


def test_the_command_sets_it_before_a_subcommand_loads_torch() -> None:
    """The variable must be in the environment before libgomp loads (it reads it once): the
    command's own process has it by the time a subcommand's module is imported."""
    code = ("import os, sys, shortlist.cli as c; c.importlib.import_module = lambda name: "
            "sys.exit(0 if os.environ.get('OMP_WAIT_POLICY') == 'PASSIVE' else 3); "
            "c.main(['train', '--data', 'd', '--out', 'o']); sys.exit(4)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
