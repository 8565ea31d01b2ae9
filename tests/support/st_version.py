"""The installed sentence-transformers release, for the tests whose expectation follows it (the floor, 6.2,
and the newest release are both supported; where 6.3 fixed a semantic bug ours follows the fix)."""

from __future__ import annotations

import sentence_transformers
import torch
from packaging.version import Version

__all__ = ["ST_6_3", "ST_VERSION", "gist_embed_loss"]

#: the installed release
ST_VERSION = Version(sentence_transformers.__version__)
#: 6.3 or newer (a 6.3 development build counts): GIST's rows are never their own negatives, the
#: multi-vector losses' similarity_fct=None is model.similarity, MatryoshkaLoss follows ``.loss`` wrappers
ST_6_3 = ST_VERSION.release[:2] >= (6, 3)


def gist_embed_loss() -> type:
    """sentence-transformers' ``GISTEmbedLoss`` with 6.3's rule that a row is never its own negative: theirs
    where 6.3 is installed; under 6.2 theirs with that rule added (its anchor-anchor and positive-positive
    scores without the row's own entry, as 6.3 writes them), so that a test of ours holds on both."""
    from sentence_transformers.sentence_transformer.losses import GISTEmbedLoss

    if ST_6_3:
        return GISTEmbedLoss

    class GISTEmbedLossNoSelfNegatives(GISTEmbedLoss):
        def sim_matrix(self, embed1, embed2):  # type: ignore[no-untyped-def]
            sim = super().sim_matrix(embed1, embed2)
            # 6.2 scores the anchors against themselves and the positives (its rows a slice at row `offset`)
            # against all positives: the row's own entry is then in column offset + row
            same = embed1.untyped_storage().data_ptr() == embed2.untyped_storage().data_ptr()
            if same and embed1.stride() == embed2.stride():
                offset = (embed1.data_ptr() - embed2.data_ptr()) // (embed2.stride(0) * embed2.element_size())
                rows = torch.arange(sim.shape[0], device=sim.device)
                sim[rows, offset + rows] = -torch.inf
            return sim

    return GISTEmbedLossNoSelfNegatives
