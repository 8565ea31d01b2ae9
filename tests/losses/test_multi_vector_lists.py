"""Lists of hard negatives with CachedMultiVectorLoss (issue 60): a list-valued negative column (its texts
flattened, ``row_counts`` per row) is scored as candidates of every query. Oracle: sentence-transformers'
non-cached ``MultiVectorMultipleNegativesRankingLoss`` on the same texts with the listed negatives cut into
columns of one text per row (InfoNCE over every candidate does not depend on which column holds one): the loss
and every parameter gradient equal, MaxSim and MeanMaxSim, chunked and tiled, with ColBERT's query expansion as
real checkpoints set it; XTR's scores and several positives are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
from sentence_transformers.multi_vector_encoder.scoring import XTRScores, mean_colbert_scores

from st_cached_losses import CachedMultiVectorLoss
from st_cached_losses.engine.lists import ROW_COUNTS
from tests.losses.test_cached_multi_vector import with_expansion
from tests.losses.test_losses import assert_grads_close, param_grads
from tests.support.tiny_model import make_tiny_multi_vector, random_texts

B = 5


@pytest.fixture(scope="module")
def mv_model(tmp_path_factory):
    return make_tiny_multi_vector(tmp_path_factory.mktemp("mv") / "bert")


def _column(model, texts: list[str], task: str, counts: torch.Tensor | None = None) -> dict:
    features = {**model.preprocess(texts, task=task), "task": task}
    return {**features, ROW_COUNTS: counts} if counts is not None else features


@pytest.mark.parametrize("expansion", [False, True], ids=["plain", "expansion"])
@pytest.mark.parametrize(
    ("similarity_fct", "scale"),
    [(None, 1.0), (mean_colbert_scores, 7.0)],
    ids=["maxsim", "meanmaxsim"],
)
@pytest.mark.parametrize(
    ("mini_batch_size", "extra"), [(2, {}), (3, {"path": "tiled", "tile_size": 2})], ids=["mb2", "mb3-tiled2"]
)
def test_lists_of_negatives_equal_sentence_transformers(
    mv_model, expansion, similarity_fct, scale, mini_batch_size, extra
):
    model = with_expansion(copy.deepcopy(mv_model), expansion)
    counts = torch.tensor([0, 3, 1, 0, 6])  # 10 negatives: two columns of one per row for the oracle
    q, p = random_texts(B, seed=1, max_words=12), random_texts(B, seed=2, max_words=12)
    n = random_texts(int(counts.sum()), seed=3, max_words=12)
    oracle = MultiVectorMultipleNegativesRankingLoss(model, scale=scale, similarity_fct=similarity_fct)
    columns = [_column(model, q, "query"), _column(model, p, "document")]
    ref, g_ref = param_grads(
        model, oracle, [*columns, _column(model, n[:B], "document"), _column(model, n[B:], "document")]
    )
    ours = CachedMultiVectorLoss(
        model, scale=scale, similarity_fct=similarity_fct, mini_batch_size=mini_batch_size, **extra
    )
    value, grads = param_grads(model, ours, [*columns, _column(model, n, "document", counts)])
    torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, g_ref, rtol=1e-5)


def test_several_positives_are_refused(mv_model):
    model = copy.deepcopy(mv_model)
    q = random_texts(3, seed=6)
    p = random_texts(4, seed=7)
    columns = [_column(model, q, "query"), _column(model, p, "document", torch.tensor([1, 2, 1]))]
    with pytest.raises(ValueError, match="CachedMultiVectorLoss takes one positive per row"):
        CachedMultiVectorLoss(model, mini_batch_size=2)(columns, None)


def test_xtr_scores_are_refused_with_lists(mv_model):
    model = copy.deepcopy(mv_model)
    columns = [
        _column(model, random_texts(3, seed=8), "query"),
        _column(model, random_texts(3, seed=9), "document"),
        _column(model, random_texts(2, seed=10), "document", torch.tensor([0, 2, 0])),
    ]
    with pytest.raises(ValueError, match="XTR's scores retrieve"):
        CachedMultiVectorLoss(model, similarity_fct=XTRScores(top_k=5), mini_batch_size=2)(columns, None)


# --------------------------------------------------------------------------- across processes

#: (name, loss options) run in one spawn per world size; "tiled" across processes is the ring
ACROSS = [
    ("maxsim-gathered", {}),
    ("maxsim-ring", {"path": "tiled", "tile_size": 2}),
    (
        "meanmaxsim-ring",
        {"similarity_fct": mean_colbert_scores, "scale": 5.0, "path": "tiled", "tile_size": 2},
    ),
]


@pytest.fixture(scope="module")
def mv_lists_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("mv_lists_dist")
    make_tiny_multi_vector(base / "bert", seed=1).save_pretrained(str(base / "mve"))
    return str(base / "mve")


def _global_rows(sizes: list[int]) -> tuple[list[str], list[str], list[str], list[int]]:
    """Queries, positives, and 2 B negatives in lists of 0-5 per row (the first process's rows none, so its list
    column is not embedded there), of ragged lengths (the processes' token widths differ)."""
    b = sum(sizes)
    counts = [0] * sizes[0] + [(3 * i) % 6 for i in range(b - sizes[0])]
    counts[-1] += 2 * b - sum(counts)
    q = random_texts(b, seed=11, min_words=1, max_words=12)
    p = random_texts(b, seed=12, min_words=1, max_words=4)
    n = random_texts(2 * b, seed=13, min_words=1, max_words=16)
    return q, p, n, counts


def _lists_worker(rank: int, world: int, path: str, sizes: list[int]) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from st_cached_losses.distributed import STATS
    from tests.losses.test_cached_multi_vector import _load_mv

    q, p, n, counts = _global_rows(sizes)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    first = sum(counts[:start])
    mine_n = n[first : first + sum(counts[mine])]
    out = {}
    for name, kwargs in ACROSS:
        model = _load_mv(path)
        ddp = DDP(model)
        loss = CachedMultiVectorLoss(model, mini_batch_size=2, gather_across_devices=True, **kwargs)
        loss.model = ddp
        columns = [
            _column(model, q[mine], "query"),
            _column(model, p[mine], "document"),
            # the first process: no negative (counts all 0, a placeholder text): the column is left out there
            _column(model, mine_n or ["unused"], "document", torch.tensor(counts[mine])),
        ]
        ddp.zero_grad(set_to_none=True)
        STATS.reset()
        value = loss(columns, None)
        value.backward()
        grads = torch.cat(
            [(g.grad if g.grad is not None else torch.zeros_like(g)).flatten() for g in model.parameters()]
        )
        out[name] = {"loss": value.item(), "grads": grads, "kinds": sorted(STATS.calls)}
    return out


@pytest.mark.parametrize("sizes", [[2, 3], [2, 3, 2]], ids=["w2", "w3"])
def test_lists_across_processes_equal_sentence_transformers(mv_lists_dir, sizes):
    """2 and 3 gloo processes with unequal batches and token widths, the lists gathered or passed around the ring
    (``path="tiled"``), MaxSim and MeanMaxSim: the mean of the processes' losses and DDP's gradients equal
    sentence-transformers' non-cached loss on the global batch, the listed negatives cut into two columns."""
    from tests.losses.test_cached_multi_vector import _load_mv
    from tests.support.dist_utils import run_distributed

    per_rank = run_distributed(_lists_worker, len(sizes), mv_lists_dir, sizes, timeout=600)
    q, p, n, _ = _global_rows(sizes)
    b = sum(sizes)
    for name, kwargs in ACROSS:
        model = _load_mv(mv_lists_dir)
        st_kwargs = {k: v for k, v in kwargs.items() if k in ("similarity_fct", "scale")}
        oracle = MultiVectorMultipleNegativesRankingLoss(model, **st_kwargs)
        columns = [_column(model, q, "query"), _column(model, p, "document")]
        columns += [_column(model, n[:b], "document"), _column(model, n[b:], "document")]
        ref, g_ref = param_grads(model, oracle, columns)
        results = [r[name] for r in per_rank]
        ring = "-ring" in name
        for r in results:  # the ring sends blocks and gathers no embedding
            assert ("ring_send" in r["kinds"]) is ring, name
        mean_loss = sum(r["loss"] for r in results) / len(results)
        assert mean_loss == pytest.approx(ref.item(), rel=1e-5), name
        for r in results:
            assert_grads_close(r["grads"], g_ref, rtol=1e-5)
