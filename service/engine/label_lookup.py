"""One label of a bundle found by its uid (GET /admin/labels/{uid}): its row, its text and which
routes serve it, so a client that lost a label change's answer can see what the change did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.engine.bundle import Bundle


@dataclass(frozen=True)
class LabelStatus:
    id: int
    uid: str
    title: str
    retired: bool  # no route returns it again; its row (and uid) stays
    on_tree_route: bool  # trained with the bundle's tree and not retired


def look_up(bundle: Bundle, uid: str) -> LabelStatus | None:
    """The label of `bundle` whose uid is `uid`, live or retired; None when no row holds it."""
    (row,) = bundle.labels.ids_of([uid])
    if row is None:
        return None
    _, title = bundle.labels.row(row)
    retired = bundle.retired is not None and bool(bundle.retired[row])
    return LabelStatus(row, uid, title, retired, bundle.has_tree and row < bundle.manifest.tree_labels and not retired)
