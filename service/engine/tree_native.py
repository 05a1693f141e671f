"""The tree's compiled loops (service/engine/_tree_native.cpp: the route's beam search and xi's
lexical term; training's sampling of negatives from p_n and step of p_n's lexical node term), or
an error saying how to build them."""

try:
    from service.engine._tree_native import ancestral_sample, beam_search, lexical_scores, node_lexical_step
except ImportError as exc:  # a source tree on the path without its build (`make install` builds it)
    raise ImportError("service.engine._tree_native, the tree's compiled loops, is not built: install the "
                      "package (`make install`, or `pip install -e .` with a C++ compiler)") from exc

__all__ = ["ancestral_sample", "beam_search", "lexical_scores", "node_lexical_step"]
