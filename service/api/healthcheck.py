"""`shortlist healthcheck`: exit 0 when the local `shortlist serve` is ready (/readyz answers 200),
1 otherwise, with one line saying which. The images' HEALTHCHECK runs it.

It asks the port and host `serve` takes from the environment (SHORTLIST_PORT, SHORTLIST_HOST), so
a container run with another port is still found. It reads those two variables itself instead of
loading every setting: the check runs every few seconds, and importing the settings (pydantic,
numpy) costs a serving box most of a second of CPU each time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import urllib.error
import urllib.request

# `shortlist serve`'s own defaults (service/api/settings.py), for a process started without the variables.
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", "8000"
# Hosts that bind every address of the machine: the check asks over loopback.
WILDCARD_HOSTS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}


def readiness_url(environ: dict[str, str] | os._Environ[str]) -> str:
    """The /readyz URL of the server these SHORTLIST_* variables configure."""
    host = environ.get("SHORTLIST_HOST") or DEFAULT_HOST
    host = WILDCARD_HOSTS.get(host, host).strip("[]")
    port = environ.get("SHORTLIST_PORT") or DEFAULT_PORT
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/readyz"


def run_cli(args: argparse.Namespace) -> int:
    port = os.environ.get("SHORTLIST_PORT", "").strip()
    if port.isdigit() and int(port) == 0:
        # Port 0 makes serve listen on a free port it picks at start-up, which no variable tells this check.
        print("not ready: SHORTLIST_PORT=0 serves on a port picked at start-up, which this check cannot know: "
              "set a port to check")
        return 1
    url = readiness_url(os.environ)
    # Never through a proxy: the server is on this machine's loopback, and Docker copies the
    # client's http_proxy into every container, where a proxy answering 200 would make a
    # container with no server healthy (audit s14 M2).
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    why = ""
    try:
        with direct.open(url, timeout=args.timeout) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status, why = exc.code, _reason(exc)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, timed out, a bad port
        print(f"not ready: {url}: {getattr(exc, 'reason', exc)}")
        return 1
    print(f"{'ready' if status == 200 else 'not ready'}: {url} answered {status}{why}")
    return 0 if status == 200 else 1


def _reason(answer: urllib.error.HTTPError) -> str:
    """What a 503 from /readyz says (its reason or message), for Docker's health log; "" if nothing."""
    try:
        body = json.loads(answer.read(4096))
        said = body.get("reason") or body.get("message") if isinstance(body, dict) else None
    except (OSError, ValueError, http.client.HTTPException):
        return ""
    return f": {str(said)[:300]}" if said else ""
