"""Schemathesis hooks for tests/test_schema_fuzz.py: `exclude` holds uids of the served bundle.

Which uids exist is data, not schema: a random uid is rightly a 422 (tested on its own), so the
fuzzer's positive cases name real labels, and its check that schema-valid requests are accepted
stays strict. The uids come from the file SHORTLIST_FUZZ_UIDS names.
"""

import os
import zlib
from pathlib import Path

import schemathesis

_UIDS = Path(os.environ["SHORTLIST_FUZZ_UIDS"]).read_text(encoding="utf-8").splitlines()


# map_case, not map_body: schemathesis applies it in the coverage phase too, which generates
# `exclude` lists of its own.
@schemathesis.hook
def map_case(ctx, case):  # noqa: ANN001, ANN201 - schemathesis's hook signature
    body = case.body
    exclude = body.get("exclude") if isinstance(body, dict) else None
    if isinstance(exclude, list) and all(isinstance(uid, str) for uid in exclude):
        body["exclude"] = [_UIDS[zlib.crc32(uid.encode("utf-8", "surrogatepass")) % len(_UIDS)] for uid in exclude]
    return case
