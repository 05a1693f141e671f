"""The tree route's hyper-parameters (TrainConfig.tree, bench/tree.py --config): the defaults and
the one check of every setting's kind and range, run before any training."""

from __future__ import annotations

from typing import Any

from service.engine.tree import MAX_BEAM
from service.engine.tree_lexical import MAX_NODE_LEXICAL_BITS
from training.config_values import (
    BATCH,
    LEARNING_RATE,
    PER_ROW_1,
    POSITIVE_WEIGHT,
    STEPS_0,
    STEPS_1,
    UNIT,
    WEIGHT,
    WIDTH_1,
    Bounds,
    json_value,
)

DEFAULT_CONFIG: dict[str, Any] = {
    # the tree p_n
    "pca_dim": 16,
    # L2 on each node's split (a sum over its pairs): 1 let deep nodes, a few hundred pairs each,
    # fit noise; on debian-tags validation, log p_n alone P@1 by lambda_n 1 / 100 / 1000 / 3000 /
    # 10000: 70.7 / 72.1 / 74.7 / 75.7 / 68.3, the truth in the beam of 512: 93.3 -> 98.5 at 3000.
    "lambda_n": 3000.0,
    "newton_steps": 1,
    "max_rounds": 3,
    # p_n's lexical node term (training/tree_node_lexical.py; TokenRows needed): every node's logit
    # reads the document's words too. debian-deps validation, own label out, beam 512: the beam
    # holds 57.7% -> 72.6% of the true labels, the route's P@1 / PSP@5 61.6 / 14.4 -> 63.8 / 20.2;
    # 2^21 slots: P@1 0.45 lower; 30 epochs (12): PSP@5 +0.65, P@1 the same, and with xi's lambda
    # 0.03 (0.01) P@1 / PSP@5 63.61 / 19.81 -> 64.21 / 19.73 at beam 128 (bench/RESULTS.md); 30
    # epochs take 45 s on debian-deps. 2^22 float16 values are 8 MiB, mapped, read by the tree route only.
    "node_lexical": True,
    "node_lexical_bits": 22,
    "node_lexical_epochs": 30,
    "node_lexical_max_steps": 4000,  # mini-batches of node_lexical_batch documents
    "node_lexical_batch": 400,
    "node_lexical_lr": 0.1,
    "node_lexical_l2": 1e-4,
    # the classifier xi
    "negatives": 8,  # per positive pair
    # regulariser strength: with the lexical node term, 0.01 / 0.03 / 0.1 trade P@1 for PSP@5 on
    # debian-deps validation (beam 256, 12 node epochs): 63.56 / 63.86 / 64.11 against 20.16 /
    # 18.82 / 18.06; 30 node epochs win the PSP@5 back at 0.03 (above).
    "lambda": 0.03,
    "regularise": "xi",  # "xi" (xi^2) or "corrected" ((xi + log p_n)^2, the Eq. 6)
    "weight_decay": 0.0,  # L2 on the v_y rows of a step
    "lexical": True,  # xi's lexical term (training/tree_lexical.py; TokenRows needed)
    "lexical_width": 20,  # labels per token row of the lexical term
    # "zero" | "one_vs_all": xi starts at the one-vs-all models of the same labels, Module III's
    # w_l, b_l (given to fit) and a logistic model of the tokens on their rows (fitted here with
    # lexical_epochs, lexical_lr, lexical_l2 as training.token_shortlist.fit_token_logistic).
    "start": "one_vs_all",
    # ...with this many times the label centroids mu_l (Module II's, unit rows) added to w_l: xi's
    # dense part starts at (w_l + gamma mu_l) . q + b_l, the centroid similarity the alpha route
    # mixes in too (no new array served; one more [L, D] float32 while xi trains). VALIDATION,
    # refitted, P@1 / PSP@5 by gamma 0 / 5 / 10 / 15: debian-deps (own label out) 65.26 / 65.61 /
    # 65.96 / 65.96 and 19.79 / 20.81 / 22.13 / 22.52; debian-tags 81.37 / 81.94 / 82.13 / 82.13 and
    # 63.29 / 64.08 / 64.75 / 65.53 (bench/RESULTS.md, issue 24).
    "start_centroids": 10.0,
    "lexical_epochs": 100,
    # ...and at most this many steps, as the token table's (TrainConfig.lexical_max_steps): 100
    # epochs of 10^6 documents were 100,000 steps; debian-deps and debian-tags reach neither cap.
    "lexical_max_steps": 4000,
    # ...and stops once an epoch lowers its loss by less than this share (as TrainConfig.lexical_tol).
    "lexical_tol": 1e-3,
    "lexical_lr": 0.05,
    "lexical_l2": 1e-5,
    "epochs": 3,
    "batch_size": 512,
    "lr": 0.2,  # Adagrad (sparse rows)
    # the scorer: enough leaves for xi + log p_n to reorder. The old p_n needed 512 (debian-tags
    # test PSP@5 59.6 at 128, 64.1 at 512); with the lexical node term debian-tags validation is
    # the same at 128 and 512 (P@1 / PSP@5 81.0 / 63.8), debian-deps validation (own label out)
    # 63.61 / 19.81 at 128, 63.56 / 20.16 at 256, 63.66 / 20.41 at 512, and the term makes each
    # node cost more: text-in p50 on debian-deps 0.76-0.91 ms at 128, 1.02-1.12 at 256, 1.29-1.42
    # at 512 (the same run: the previous p_n at 512, 0.90-0.96).
    "beam": 128,
}

# The range of every numeric setting (the maxima: training.config_values). A setting that counts
# steps or epochs may be 0 (that part is not trained).
_BOUNDS: dict[str, Bounds] = {
    "pca_dim": WIDTH_1, "newton_steps": STEPS_1, "max_rounds": STEPS_1,
    "node_lexical_bits": Bounds(1, MAX_NODE_LEXICAL_BITS), "node_lexical_epochs": STEPS_0,
    "node_lexical_max_steps": STEPS_0, "node_lexical_batch": BATCH, "negatives": PER_ROW_1,
    "lexical_width": PER_ROW_1, "lexical_epochs": STEPS_0, "lexical_max_steps": STEPS_1, "epochs": STEPS_0,
    "batch_size": BATCH, "beam": Bounds(1, MAX_BEAM),  # the engine's widest beam: a bundle's default_beam
    "lambda_n": POSITIVE_WEIGHT, "node_lexical_lr": LEARNING_RATE, "lexical_lr": LEARNING_RATE, "lr": LEARNING_RATE,
    "node_lexical_l2": WEIGHT, "lambda": WEIGHT, "weight_decay": WEIGHT, "start_centroids": WEIGHT,
    "lexical_tol": UNIT, "lexical_l2": WEIGHT,  # tol: a share of the loss
}
_CHOICES: dict[str, tuple[str, ...]] = {"regularise": ("xi", "corrected"), "start": ("zero", "one_vs_all")}


def setting_bounds() -> dict[str, Bounds]:
    """The range of every numeric tree setting, by its name in a training config (tree.beam)."""
    return {f"tree.{key}": bounds for key, bounds in _BOUNDS.items()}


def resolve_config(config: dict[str, Any]) -> dict[str, Any]:
    """DEFAULT_CONFIG overridden by `config`, every value checked; ValueError naming the first
    unknown key, or the setting of the wrong kind or out of its range."""
    json_value("tree", "dict[str, Any]", config)
    unknown = sorted(set(config) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(f"unknown tree config keys: {', '.join(unknown)} (known: {', '.join(DEFAULT_CONFIG)})")
    cfg = dict(DEFAULT_CONFIG)
    for key, value in config.items():
        cfg[key] = json_value(f"tree.{key}", type(DEFAULT_CONFIG[key]).__name__, value)
    for key, bounds in _BOUNDS.items():
        bounds.check(f"tree.{key}", cfg[key], integer=isinstance(DEFAULT_CONFIG[key], int))
    for key, allowed in _CHOICES.items():
        if cfg[key] not in allowed:
            raise ValueError(f"training config 'tree.{key}' must be one of {allowed}, got {cfg[key]!r}")
    return cfg
