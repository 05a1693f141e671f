"""What a user would build instead of Shortlist: napkinXC PLT on TF-IDF behind a small but
competent FastAPI app, the same request and response shape as /v1/predict. bench/http_bench.py
starts it beside Shortlist (--peer-run) and measures both in the same run.

    PEER_RUN=bench/out/debian-deps PEER_DATA=../shared/data/debian-deps \
        python -m uvicorn peer_service:create_app --factory --app-dir bench --no-access-log

PEER_RUN is a bench/peers.py run directory with napkinXC trained in it (its
models/napkinxc and tokenizer.json), PEER_DATA the dataset (its lbl file). The same stack as `shortlist
serve` (uvicorn, uvloop, httptools, pydantic request models, orjson answers); the model is
called inline in the async route (a ~0.1 ms call: a thread-pool hop would cost more than it
frees), with the text featurised by the same tokenizer the peer was trained on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import orjson
from fastapi import FastAPI
from pydantic import BaseModel, Field, model_validator
from starlette.responses import Response

from service.engine.tokenizer import Tokenizer
from training.data import load_labels


class PredictRequest(BaseModel):
    text: Annotated[str, Field(max_length=2000)] | None = None
    texts: Annotated[list[Annotated[str, Field(max_length=2000)]], Field(min_length=1, max_length=128)] | None = None
    k: int = Field(10, ge=1, le=100)

    @model_validator(mode="after")
    def _one_of(self) -> PredictRequest:
        if (self.text is None) == (self.texts is None):
            raise ValueError("give exactly one of text and texts")
        return self


def create_app() -> FastAPI:
    from napkinxc.models import PLT

    run = Path(os.environ["PEER_RUN"])
    tokenizer = Tokenizer.load(run / "tokenizer.json")
    labels = load_labels(os.environ["PEER_DATA"])
    model = PLT(str(run / "models" / "napkinxc"), threads=1)
    model.load()
    uids, titles = labels.uids, labels.titles
    app = FastAPI(title="napkinXC peer")

    def rows(texts: list[str]) -> list[list[tuple[int, float]]]:
        out = []
        for text in texts:
            ids, weights = tokenizer.encode(text)
            out.append([(i - 1, w) for i, w in zip(ids, weights, strict=True)])
        return out

    @app.post("/v1/predict")
    async def predict(req: PredictRequest) -> Response:
        texts = [req.text] if req.text is not None else req.texts
        answers = model.predict_proba(rows(texts), top_k=req.k)  # type: ignore[arg-type]
        results = [[{"id": int(i), "uid": uids[i], "title": titles[i], "score": float(s)} for i, s in row]
                   for row in answers]
        return Response(orjson.dumps({"version": "napkinxc", "results": results}), media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    return app
