"""The installed sentence-transformers release, for the tests whose expectation follows it (the floor, 6.2,
and the newest release are both supported; where 6.3 fixed a semantic bug ours follows the fix)."""

from __future__ import annotations

import sentence_transformers
from packaging.version import Version

__all__ = ["ST_6_3", "ST_VERSION"]

#: the installed release
ST_VERSION = Version(sentence_transformers.__version__)
#: 6.3 or newer (a 6.3 development build counts): GIST's rows are never their own negatives, the
#: multi-vector losses' similarity_fct=None is model.similarity, MatryoshkaLoss follows ``.loss`` wrappers
ST_6_3 = ST_VERSION.release[:2] >= (6, 3)
