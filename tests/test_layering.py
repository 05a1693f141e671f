"""The service is the bottom layer: it runs where torch, training and model_export are absent."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

FORBIDDEN = {"torch", "training", "model_export", "onnx"}
SERVICE = Path(__file__).resolve().parents[1] / "service"


def test_service_sources_never_import_training_side_packages():
    offenders = []
    for path in SERVICE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_service_loads_and_predicts_with_torch_unavailable(bundle_root):
    # A None entry in sys.modules makes any import of that package fail, as if not installed.
    code = f"""
import sys
for name in {sorted(FORBIDDEN)!r}:
    sys.modules[name] = None
from service.api import create_app
from service.api.settings import Settings
from service.engine import Bundle, Predictor
create_app(Settings(bundle_root={str(bundle_root)!r}))
predictor = Predictor(Bundle.load({str(bundle_root / "v1")!r}))
print(len(predictor.predict(["hello world"], k=3)[0]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
