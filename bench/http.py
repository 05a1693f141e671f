"""HTTP throughput and latency of `shortlist serve` against the framework's floor: see http_bench.py.

    python bench/http.py --bundle-root ROOT [--version V] [--data ../shared/data/debian-deps]

This file's name is also the standard library's `http` package, and Python puts a script's
folder first on sys.path: any script run from bench/ that imports http (torch, urllib.request
and httpx all do) finds this file first. When imported under that name it hands the real
package back, so it shadows nothing.
"""

import sys

if __name__ == "http":
    import importlib
    import os

    _here = os.path.dirname(os.path.abspath(__file__))
    _saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    del sys.modules["http"]
    try:
        # The import system returns whatever sys.modules holds under this name once this
        # file has run, so `import http.client` gets the standard library's package.
        sys.modules["http"] = importlib.import_module("http")
    finally:
        sys.path[:] = _saved
elif __name__ == "__main__":
    from http_bench import main

    sys.exit(main())
