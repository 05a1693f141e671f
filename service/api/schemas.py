"""The API schema: every request and response body, defined once.

Limits that are configurable (text length, k, batch size, beam, exclusions) are checked by validators
reading `Limits` from the validation context, so they fail with the same field-named 422
as every other schema error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


@dataclass(frozen=True)
class Limits:
    max_text_chars: int = 2000
    max_k: int = 100
    max_batch: int = 128
    max_beam: int = 256
    max_exclude: int = 1000


def _limits(info: ValidationInfo) -> Limits:
    ctx = info.context or {}
    return ctx.get("limits", Limits())


def _check_text(text: str, limits: Limits) -> str:
    if not text.strip():
        raise ValueError("text is empty or whitespace-only")
    if len(text) > limits.max_text_chars:
        raise ValueError(f"text has {len(text)} characters, the limit is {limits.max_text_chars}")
    return text


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PredictRequest(_Strict):
    """Exactly one of `text` and `texts`."""

    text: str | None = Field(None, description="one text to label")
    texts: list[str] | None = Field(None, description="several texts, answered in order")
    k: int = Field(10, ge=1, description="labels per text, 1..max_k")
    alpha: float | None = Field(
        None, ge=0.0, le=1.0, description="classifier weight in [0, 1]; default: the bundle's"
    )
    beam: int | None = Field(None, ge=1, description="tree endpoint only: beam width")
    exclude: list[str] | None = Field(
        None,
        description="label uids never to return, for every text of the request (the text's own label "
        "when texts are labels too, items already chosen); the next best labels take their places; "
        "at most max_exclude",
    )

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha_number(cls, v: Any) -> Any:
        # Strict mode would refuse an integer 0 or 1, which is a perfectly good alpha.
        if isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        return v

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else _check_text(v, _limits(info))

    @field_validator("texts")
    @classmethod
    def _texts(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if v is None:
            return None
        limits = _limits(info)
        if not v:
            raise ValueError("texts is empty; send at least one text")
        if len(v) > limits.max_batch:
            raise ValueError(f"texts has {len(v)} items, the limit is {limits.max_batch}")
        for i, t in enumerate(v):
            try:
                _check_text(t, limits)
            except ValueError as exc:
                raise ValueError(f"texts[{i}]: {exc}") from None
        return v

    @field_validator("k")
    @classmethod
    def _k(cls, v: int, info: ValidationInfo) -> int:
        limit = _limits(info).max_k
        if v > limit:
            raise ValueError(f"k is {v}, the limit is {limit}")
        return v

    @field_validator("beam")
    @classmethod
    def _beam(cls, v: int | None, info: ValidationInfo) -> int | None:
        limit = _limits(info).max_beam
        if v is not None and v > limit:
            raise ValueError(f"beam is {v}, the limit is {limit}")
        return v

    @field_validator("exclude")
    @classmethod
    def _exclude(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        limit = _limits(info).max_exclude
        if v is not None and len(v) > limit:
            raise ValueError(f"exclude has {len(v)} uids, the limit is {limit}")
        return v

    @model_validator(mode="after")
    def _one_of(self) -> PredictRequest:
        if (self.text is None) == (self.texts is None):
            raise ValueError("send exactly one of 'text' and 'texts'")
        return self

    @property
    def all_texts(self) -> list[str]:
        return [self.text] if self.text is not None else list(self.texts or [])


class Label(BaseModel):
    id: int = Field(description="label row in the bundle")
    uid: str
    title: str
    score: float = Field(description="the ranking score (alpha mixture of calibrated scores plus the lexical term): "
                         "comparable within one bundle, not a probability")


class PredictResponse(BaseModel):
    version: str = Field(description="the bundle version that answered")
    results: list[list[Label]] = Field(description="one list per input text, best first")


class ErrorDetail(BaseModel):
    field: str = Field(description="where the problem is, e.g. 'body.k' or 'body.texts[2]'")
    message: str


class ErrorResponse(BaseModel):
    error: str = Field(description="a short machine-readable code")
    message: str
    details: list[ErrorDetail] = Field(default_factory=list)
    request_id: str | None = None


class EchoRequest(_Strict):
    text: str


class EchoResponse(BaseModel):
    text: str


class Health(BaseModel):
    status: str
    version: str | None = None


class ActivateRequest(_Strict):
    version: str = Field(description="a bundle directory name under the bundle root")


class BundleInfo(BaseModel):
    version: str
    created_at: str
    active: bool
    has_tree: bool
    metrics: dict[str, Any] = Field(default_factory=dict)


class BundleList(BaseModel):
    active: str | None
    bundles: list[BundleInfo]


class ActivationResult(BaseModel):
    active: str
    previous: str | None
    seconds: float
    quality: dict[str, float] = Field(default_factory=dict)
