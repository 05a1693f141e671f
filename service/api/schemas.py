"""The API schema: every request and response body, defined once.

Request limits come from the running settings: `RequestModels(settings)` is the one place they
are derived, as constraints of the request models, so FastAPI validates them and /openapi.json
documents them; the published schema is the validator.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from service.api.settings import Settings
from service.engine.schema import VERSION_RE
from service.engine.tokenizer import load_unicode_tables, non_blank_pattern, normalized_length_exceeds

# A text must hold a character that is not blank (tokenizer.is_blank_char: Unicode whitespace,
# control and format characters; "\u00a0" or "\u200b" alone were answered as an empty text).
# Spelled out as ranges: regex engines disagree on what `\s` covers, and the schema must mean
# to a client what it means to the validator.
NON_BLANK = non_blank_pattern()
# A label change's precondition (the body's field; DELETE's query parameter): a change retried
# after its answer was lost is refused, not applied twice or answered as a bad request.
EXPECTED_ACTIVE_HELP = ("change labels only while this version is the active one, else 409 active_version_changed "
                        "and nothing done: a retried change (its answer lost) is then applied once")
EXPECTED_ACTIVE = Field(None, pattern=VERSION_RE.pattern, description=EXPECTED_ACTIVE_HELP)


def _one_of_text(schema: dict[str, Any]) -> None:
    """A body taking exactly one of `text` and `texts`, published as two whole objects, each
    with its own title: a client generator makes a typed model of each (`oneOf` over bare
    `required` lists left it an untyped `Any`), and the schema still validates what the model does."""
    title, properties = schema["title"], schema.pop("properties")
    for key in ("type", "additionalProperties", "required"):
        schema.pop(key, None)
    schema["oneOf"] = [
        {"type": "object", "title": f"{title}{variant}", "description": description, "required": [key],
         "properties": {name: p for name, p in properties.items() if name != other}, "additionalProperties": False}
        for variant, key, other, description in (("One", "text", "texts", "one text"),
                                                  ("Batch", "texts", "text", "several texts, answered in order"))]


def _whole(value: Any) -> Any:
    """16.0 is the integer 16 to JSON Schema (and to a JavaScript client); 2.5 stays invalid."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON Schema defines it: any number with no fraction (never a string or a bool).
Whole = Annotated[int, BeforeValidator(_whole)]


def _normalized_within(limit: int) -> AfterValidator:
    """A text's limit in the form the tokenizer reads (NFKC): the tokenizer's work follows that
    length, which a character can multiply by 18. Checked at the edge, before texts share an
    engine call with other requests' (service.api.batching), so a refusal names its own field;
    counting stops past the limit, so a refusal costs about the limit's worth of work."""

    def check(text: str) -> str:
        if normalized_length_exceeds(text, limit):
            raise ValueError(f"longer than {limit} characters after Unicode NFKC normalisation (the form the "
                             f"tokenizer reads: one character can become up to 18), the limit "
                             f"SHORTLIST_MAX_NORMALIZED_CHARS")
        return text

    return AfterValidator(check)


def text_type(settings: Settings) -> Any:
    """A text to label (a request's `text`, an item of its `texts`, a new label's title) under
    `settings`' limits: the one definition, for the request models and for TextCheck."""
    return Annotated[str, StringConstraints(min_length=1, max_length=settings.max_text_chars, pattern=NON_BLANK),
                     _normalized_within(settings.normalized_text_limit)]


# Why the API refuses a text, by the error type its validator (text_type) reports first: the
# constraints are checked in this order, and a request's text gets one error.
TEXT_REFUSALS = {
    "string_too_short": "blank",  # empty
    "string_pattern_mismatch": "blank",  # whitespace, control or format characters only
    "string_too_long": "past_max_text_chars",
    "value_error": "past_max_normalized_chars",
}


class TextCheck:
    """The API's own check of a text, offline (`shortlist eval` counts the texts it scores that a
    client could not send): the request models' validator itself, so the two cannot drift."""

    def __init__(self, settings: Settings) -> None:
        load_unicode_tables()
        self.settings = settings
        self._adapter: TypeAdapter[str] = TypeAdapter(text_type(settings))

    def refusal(self, text: str) -> str | None:
        """Why POST /v1/predict refuses `text` with 422 (a TEXT_REFUSALS value), None when it takes it."""
        try:
            self._adapter.validate_python(text)
        except ValidationError as exc:
            return TEXT_REFUSALS[exc.errors(include_input=False)[0]["type"]]
        return None


class _Request(BaseModel):
    # Strict: "3" is not a k, 1.5 is not a k, true is not a number.
    model_config = ConfigDict(extra="forbid", strict=True)


class _OneOfText(_Request):
    model_config = ConfigDict(json_schema_extra=_one_of_text)

    @model_validator(mode="after")
    def _one_of(self) -> _OneOfText:
        if (self.text is None) == (self.texts is None):  # type: ignore[attr-defined]
            raise ValueError("send exactly one of 'text' and 'texts'")
        return self

    @property
    def all_texts(self) -> list[str]:
        text: str | None = self.text  # type: ignore[attr-defined]
        return [text] if text is not None else list(self.texts)  # type: ignore[attr-defined]


class RequestModels:
    """The request bodies under the limits of `settings`."""

    def __init__(self, settings: Settings) -> None:
        load_unicode_tables()  # built here, not by the first request that needs them (~0.25 s)
        normalized = _normalized_within(settings.normalized_text_limit)
        Text = text_type(settings)  # noqa: N806
        Texts = Annotated[list[Text], Field(min_length=1, max_length=settings.max_batch)]  # noqa: N806

        class _Predict(_OneOfText):
            # Absent, never null: exactly one of the two is sent.
            text: Text = Field(None, description="one text to label")  # type: ignore[assignment]
            texts: Texts = Field(None, description="several texts, answered in order")  # type: ignore[assignment]
            k: Whole = Field(10, ge=1, le=settings.max_k, description="labels per text")
            exclude: list[str] | None = Field(
                None, max_length=settings.max_exclude,
                description="label uids never returned for any text of the request (the text's own label when "
                "texts are labels too, items already chosen); the next best labels take their places; an unknown "
                "uid is a 422",
            )

        class PredictRequest(_Predict):
            """Exactly one of `text` and `texts`."""

            alpha: float | None = Field(None, ge=0.0, le=1.0, description="classifier weight; default: the bundle's")

        class TreePredictRequest(_Predict):
            """Exactly one of `text` and `texts`."""

            beam: Annotated[int, Field(ge=1, le=settings.max_beam), BeforeValidator(_whole)] | None = Field(
                None, description="beam width; default: the tree's")

        class EchoRequest(_Request):
            text: str

        self.predict, self.tree_predict, self.echo = PredictRequest, TreePredictRequest, EchoRequest
        # new_label: one new label, the add route's item and a row of `shortlist labels add`'s file.
        self.add_labels, self.retire_labels, self.uid, self.new_label = _label_requests(settings, Text, normalized)
        self.max_listed_bundles = settings.max_listed_bundles  # GET /admin/bundles' page ceiling


def _label_requests(settings: Settings, text: Any, normalized: AfterValidator) -> tuple[
        type[BaseModel], type[BaseModel], Any, type[BaseModel]]:
    """The admin label-change bodies under the limits of `settings` (`text`: a request's text type;
    `normalized`: its limit after normalisation), the type of a uid (a path parameter too) and
    the model of one new label."""
    Uid = Annotated[str, StringConstraints(min_length=1, max_length=settings.max_uid_chars, pattern=NON_BLANK)]  # noqa: N806

    class NewLabel(_Request):
        uid: Uid = Field(description="the label's id, unique among the bundle's labels (live or retired)")
        title: text = Field(description="the label's text, encoded as training encoded label titles")
        # The limit on the string, not on the Optional around it (pydantic said "items").
        content: Annotated[str, StringConstraints(max_length=settings.max_text_chars), normalized] | None = Field(
            None, description="more text (read where the bundle was trained on title+content)")
        prior: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                    description="how common the label is expected to be, as a quantile of the "
                                    "trained labels' priors (0.5: a typical label, 1: as common as the most "
                                    "common); its text cannot say. Default: the service's for every added label")

    class AddLabelsRequest(_Request):
        labels: list[NewLabel] = Field(min_length=1, max_length=settings.max_label_batch,
                                       description="labels to add, as one new bundle version")
        expected_active: str | None = EXPECTED_ACTIVE

    class RetireLabelsRequest(_Request):
        uids: list[Uid] = Field(min_length=1, max_length=settings.max_label_batch,
                                description="uids of live labels to retire, as one new bundle version")
        expected_active: str | None = EXPECTED_ACTIVE

    return AddLabelsRequest, RetireLabelsRequest, Uid, NewLabel


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
    """The one error body of every 4xx and 5xx."""

    error: str = Field(description="a short machine-readable code")
    message: str
    details: list[ErrorDetail] = Field(default_factory=list)
    request_id: str | None = None


class EchoResponse(BaseModel):
    text: str


class Health(BaseModel):
    status: str
    version: str | None = None
    reason: str | None = None  # /readyz's 503: why not ready; /healthz: a problem it serves despite
    processes: dict[str, str] | None = None  # /readyz's 503 with several processes: pid -> why not ready


class ActivateRequest(_Request):
    version: str = Field(pattern=VERSION_RE.pattern, description="a bundle directory name under the bundle root")


class RollbackRequest(_Request):
    expected_active: str | None = Field(
        None, pattern=VERSION_RE.pattern,
        description="roll back only while this version is the active one, else 409 active_version_changed and "
                    "nothing done: a retried rollback (its answer lost) then rolls back once, not once per attempt")


class LabelInfo(BaseModel):
    version: str = Field(description="the active version, which answered")
    id: int = Field(description="label row in the bundle (stable across derived versions)")
    uid: str
    title: str
    retired: bool = Field(description="retired: no route returns it again (its row and uid stay)")
    on_tree_route: bool = Field(description="/v1/predict/tree can return it: trained with the tree and not retired "
                                "(labels added live join it at the next training)")


class BundleLineage(BaseModel):
    parent: str
    base: str
    added: int
    retired: int
    tree_labels: int = Field(description="labels the tree scorer (/v1/predict/tree) serves: those trained")


class BundleInfo(BaseModel):
    version: str
    created_at: str
    active: bool
    has_tree: bool
    place: str = Field(description="'root': the bundle root (exported); 'state': the state directory "
                       "(derived by label changes)")
    num_labels: int
    unconfirmed: bool = Field(False, description="a label change's version that a crash left before its "
                              "activation: never served unless activated by name; set aside at the next "
                              "change or start-up")
    shadowed: bool = Field(False, description="a bundle root's bundle whose version the state directory also "
                           "holds: never served; the version is the state directory's (a label change's, the one "
                           "the active record and rollback history name). Rename or remove this one")
    lineage: BundleLineage | None = Field(None, description="for a bundle derived by label changes")
    metrics: dict[str, Any] = Field(default_factory=dict)


class BundleList(BaseModel):
    active: str | None
    bundles: list[BundleInfo] = Field(description="this page of the bundles, oldest first")
    total: int = Field(description="bundles listed in every page")
    next_offset: int | None = Field(description="the `offset` of the next page; null on the last")


class SkippedVersion(BaseModel):
    version: str
    reason: str


class ActivationResult(BaseModel):
    active: str
    previous: str | None
    seconds: float
    quality: dict[str, float] = Field(default_factory=dict)
    # With several serving processes: what each serves (by pid) when the activation answered.
    processes: dict[str, str | None] = Field(default_factory=dict)
    # Rollback: the more recent history entries passed over (and dropped) because they no longer load.
    skipped: list[SkippedVersion] = Field(default_factory=list)
    # Activate: the version asked for serves already (and is the one recorded): nothing was loaded or
    # pushed onto the rollback history.
    unchanged: bool = False


class LabelChangeResult(BaseModel):
    active: str = Field(description="the new version, now serving")
    previous: str | None
    seconds: float = Field(description="from the change's start (after those queued before it) to the swap")
    derive_seconds: float = Field(description="writing the new bundle")
    added: int
    retired: int
    num_labels: int = Field(description="label rows of the new version (retired ones included)")
    tree_labels: int = Field(description="labels /v1/predict/tree serves: those trained; labels added later join "
                             "the tree at the next training")
    quality: dict[str, float] = Field(default_factory=dict)
    # With several serving processes: what each serves (by pid) when the change answered.
    processes: dict[str, str | None] = Field(default_factory=dict)
