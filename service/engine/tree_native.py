"""The tree route's compiled loops (service/engine/_tree_search.cpp: the beam search and xi's
lexical term), or an error saying how to build them."""

try:
    from service.engine._tree_search import beam_search, lexical_scores
except ImportError as exc:  # a source tree on the path without its build (`make install` builds it)
    raise ImportError("service.engine._tree_search, the tree route's compiled search, is not built: install the "
                      "package (`make install`, or `pip install -e .` with a C++ compiler)") from exc

__all__ = ["beam_search", "lexical_scores"]
