"""Graphs kept within a memory budget: a budget that holds every mini-batch replays none
(forwards counted) and gives the replay path's gradients bit for bit, dropout included; a budget for k
of n mini-batches replays exactly n - k; the sizes are parsed the same everywhere; across processes
(DDP and FSDP2, 2 gloo processes, unequal batches) kept graphs still give one gradient reduction per
step and the global batch's gradients."""

from __future__ import annotations

import pytest
import torch

import st_cached_losses
from st_cached_losses.engine.checks import memory_bytes
from st_cached_losses.engine.graph_budget import GraphMeter
from tests.support.dist_utils import run_distributed
from tests.support.tiny_model import make_tiny_model, random_texts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("budget_model")
    make_tiny_model(base / "bert").save(str(base / "st"))
    return str(base / "st")


@pytest.fixture(scope="module")
def dropout_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("budget_dropout_model")
    make_tiny_model(base / "bert", dropout=0.3, seed=1).save(str(base / "st"))
    return str(base / "st")


def _load(path: str, train: bool = True):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    model[0].auto_model.pooler = None
    model.train(train)  # dropout on: kept graphs and replays must see the same masks
    return model


def _equal_length_texts(n: int, words: int = 6, seed: int = 0) -> list[str]:
    return [" ".join(random_texts(words, seed=seed + i, min_words=1, max_words=1)) for i in range(n)]


class _Forwards:
    """Counts the encoder's forwards."""

    def __init__(self, model) -> None:
        self.n = 0
        self.handle = model[0].register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def _step(model, loss, feats, seed: int = 0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    counter = _Forwards(model)
    value = loss(feats, None)
    stage1 = counter.n
    value.backward()
    counter.handle.remove()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return value.item(), grads, stage1, counter.n - stage1


@pytest.mark.parametrize("cls_name", ["CachedMNRLoss", "CachedCLIPLoss", "CachedTiledLoss"])
def test_budget_holding_everything_replays_nothing_same_gradients(model_dir, cls_name):
    model = _load(model_dir)
    texts = [random_texts(8, seed=k) for k in range(3)]
    feats = [model.preprocess(t) for t in texts]
    cls = getattr(st_cached_losses, cls_name)
    plain = cls(model, mini_batch_size=2)
    budget = cls(model, mini_batch_size=2, graph_memory_budget="1GB")
    loss0, grads0, fwd0, replays0 = _step(model, plain, feats)
    loss1, grads1, fwd1, replays1 = _step(model, budget, feats)
    assert fwd0 == fwd1 == 12  # 3 columns x 4 mini-batches
    assert replays0 == 11 and replays1 == 0  # the last graph is kept either way
    assert grads0.abs().max() > 0
    assert loss0 == loss1
    assert torch.equal(grads0, grads1), (grads0 - grads1).abs().max()


def test_dropout_is_replayed_exactly_with_kept_graphs(dropout_dir):
    """Kept graphs and replays together (k of n kept) give the all-replay gradients bit for bit, in
    training mode; without dropout they would also match a run with other masks, so check that the
    masks matter: another seed gives other gradients."""
    model = _load(dropout_dir)
    feats = [model.preprocess(random_texts(8, seed=k)) for k in range(2)]
    plain = st_cached_losses.CachedMNRLoss(model, mini_batch_size=2)
    _, grads0, _, _ = _step(model, plain, feats, seed=1)
    _, other, _, _ = _step(model, plain, feats, seed=2)
    assert not torch.allclose(grads0, other), "dropout must be on for this test to mean anything"
    meter_bytes = _one_mini_batch_bytes(model, feats)
    half = st_cached_losses.CachedMNRLoss(
        model, mini_batch_size=2, graph_memory_budget=int(3.5 * meter_bytes)
    )
    _, grads1, _, replays = _step(model, half, feats, seed=1)
    assert 0 < replays < 7
    assert torch.equal(grads0, grads1)


def _one_mini_batch_bytes(model, feats) -> int:
    """What the engine's meter measures for the largest mini-batch of 2 rows of these columns."""
    meter = GraphMeter(model)
    out: list[int] = []
    from st_cached_losses.engine.features import slice_features

    biggest = 0
    for f in feats:
        b = f["input_ids"].shape[0]
        for start in range(0, b, 2):
            rows = torch.arange(start, min(start + 2, b))
            out.clear()
            with meter.measure(torch.device("cpu"), out):
                model(dict(slice_features(f, rows, b)))["sentence_embedding"]
            biggest = max(biggest, out[0])
    return biggest


@pytest.mark.parametrize("k", [0, 1, 3])
def test_budget_for_k_mini_batches_replays_n_minus_k(model_dir, k):
    model = _load(model_dir, train=False)
    # equal lengths: every mini-batch has the same graph size, so the budget holds exactly k of them
    feats = [model.preprocess(_equal_length_texts(8, seed=10 * c)) for c in range(2)]
    one = _one_mini_batch_bytes(model, feats)
    loss = st_cached_losses.CachedMNRLoss(
        model, mini_batch_size=2, reuse_last_graph=False, graph_memory_budget=k * one + one // 2 if k else 1
    )
    plain = st_cached_losses.CachedMNRLoss(model, mini_batch_size=2, reuse_last_graph=False)
    _, grads0, _, replays0 = _step(model, plain, feats)
    _, grads1, forwards, replays = _step(model, loss, feats)
    assert forwards == 8 and replays0 == 8
    assert replays == 8 - k
    torch.testing.assert_close(grads1, grads0, rtol=0, atol=0)


def test_memory_sizes_parse_alike():
    assert memory_bytes("6GB", "x") == 6 * 10**9
    assert memory_bytes("6GiB", "x") == 6 * 2**30
    assert memory_bytes("1.5 gib", "x") == int(1.5 * 2**30)
    assert memory_bytes("512MB", "x") == 512 * 10**6
    assert memory_bytes(1024, "x") == 1024
    assert memory_bytes(None, "x") is None
    for bad in ("6 parsecs", "-1GB", "", 0, -5, True, 1.5):
        with pytest.raises(ValueError, match="x must be"):
            memory_bytes(bad, "x")


def test_losses_take_budgets_as_sizes(model_dir):
    model = _load(model_dir)
    loss = st_cached_losses.CachedMNRLoss(model, graph_memory_budget="2GiB", memory_budget="64MiB")
    assert loss.graph_memory_budget == 2 * 2**30 and loss.memory_budget == 64 * 2**20
    loss.graph_memory_budget = "1GB"
    assert loss.graph_memory_budget == 10**9
    loss.graph_memory_budget = None
    assert loss.graph_memory_budget is None
    with pytest.raises(ValueError, match="graph_memory_budget must be"):
        loss.graph_memory_budget = "lots"
    with pytest.raises(ValueError, match="memory_budget must be"):
        st_cached_losses.CachedCLIPLoss(model, memory_budget="lots")


# --------------------------------------------------------------------------- across processes

SIZES = [5, 3]


def _dist_worker(rank: int, world: int, path: str, wrapper: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from st_cached_losses.distributed import STATS

    model = _load(path, train=False)
    reductions = {"n": 0}
    if wrapper.startswith("ddp"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped = DDP(model, static_graph=wrapper == "ddp-static")

        def hook(state, bucket):
            reductions["n"] += 1
            return default_hooks.allreduce_hook(None, bucket)

        wrapped.register_comm_hook(None, hook)
    else:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        for layer in model[0].auto_model.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        wrapped = model

        # FSDP2 reduce-scatters through torch.distributed (the name varies across torch versions)
        def counting(original):
            def counted(*args, **kwargs):
                reductions["n"] += 1
                return original(*args, **kwargs)

            return counted

        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            if hasattr(dist, name):
                setattr(dist, name, counting(getattr(dist, name)))
    out = {}
    for budget in (None, "1GB"):
        loss = st_cached_losses.CachedCLIPLoss(
            model,
            mini_batch_size=2,
            gather_across_devices=True,
            learnable_scale=True,
            graph_memory_budget=budget,
        )
        loss.model = wrapped
        texts = [random_texts(sum(SIZES), seed=k) for k in range(2)]
        start = sum(SIZES[:rank])
        feats = [model.preprocess(t[start : start + SIZES[rank]]) for t in texts]
        model.zero_grad(set_to_none=True)
        reductions["n"] = 0
        STATS.reset()
        counter = _Forwards(model)
        value = loss(feats, None)
        stage1 = counter.n
        value.backward()
        counter.handle.remove()
        grads = []
        for p in model.parameters():
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            grads.append(g.flatten() if g is not None else torch.zeros(p.numel()))
        out[str(budget)] = {
            "grads": torch.cat(grads),
            "replays": counter.n - stage1,
            "reductions": reductions["n"],
            "scale_grad": float(loss.logit_scale.grad),
        }
    return out


@pytest.mark.parametrize("wrapper", ["ddp", "ddp-static", "fsdp2"])
def test_kept_graphs_across_processes_one_reduction_same_gradients(model_dir, wrapper):
    per_rank = run_distributed(_dist_worker, 2, model_dir, wrapper)
    for rank, r in enumerate(per_rank):
        plain, kept = r["None"], r["1GB"]
        assert kept["replays"] == 1, (rank, kept["replays"])  # only the synchronised last one
        assert plain["replays"] > kept["replays"]
        assert kept["reductions"] == plain["reductions"] > 0, (rank, kept, plain)
        torch.testing.assert_close(kept["grads"], plain["grads"], rtol=1e-5, atol=1e-7)
        assert kept["scale_grad"] == pytest.approx(plain["scale_grad"], rel=1e-5)
    torch.testing.assert_close(per_rank[0]["1GB"]["grads"], per_rank[1]["1GB"]["grads"], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- mini_batch_size="auto"


def _longest_rows_bytes_per_row(model, feats) -> float:
    """A one-size probe's bytes per row: a forward of the batch's longest rows (PROBE_ROWS), its bytes
    divided by its rows (the fixed cost of a forward counted per row)."""
    from st_cached_losses.engine.auto_size import PROBE_ROWS
    from st_cached_losses.engine.features import row_lengths, slice_features

    lengths = [row_lengths(f, f["input_ids"].shape[0]) for f in feats]
    k = max(range(len(feats)), key=lambda c: int(lengths[c].max()))
    b = feats[k]["input_ids"].shape[0]
    rows = torch.argsort(lengths[k], descending=True, stable=True)[:PROBE_ROWS]
    out: list[int] = []
    with GraphMeter(model).measure(torch.device("cpu"), out):
        model(dict(slice_features(feats[k], rows, b)))["sentence_embedding"]
    return out[0] / len(rows)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_auto_mini_batch_fits_the_budget_and_changes_nothing(model_dir, rows):
    model = _load(model_dir, train=False)
    feats = [model.preprocess(random_texts(12, seed=k)) for k in range(2)]
    per_row = _longest_rows_bytes_per_row(model, feats)
    budget = int(per_row * (rows + 0.5))  # room for `rows` of the longest rows by a one-size probe's count
    auto = st_cached_losses.CachedMNRLoss(model, mini_batch_size="auto", mini_batch_memory_budget=budget)
    _, grads_auto, forwards, _ = _step(model, auto, feats)
    size = auto.cache.auto_size
    # at least as many: the fixed cost is counted once, not per row (tests/engine/test_auto_size.py: how many)
    assert auto.mini_batch_size == "auto" and size is not None and rows <= size <= 2 * rows + 1
    assert forwards == 2 * -(-12 // size) + 2  # ceil(12 / size) per column, and the probe's two forwards
    explicit = st_cached_losses.CachedMNRLoss(model, mini_batch_size=size)
    _, grads, _, _ = _step(model, explicit, feats)
    torch.testing.assert_close(grads_auto, grads, rtol=0, atol=0)
    other = st_cached_losses.CachedMNRLoss(model, mini_batch_size=4)
    _, grads_other, _, _ = _step(model, other, feats)
    # another size, the same gradients (one tolerance over the whole vector)
    assert (grads_auto - grads_other).abs().max() <= 1e-5 * grads_other.abs().max()


def test_auto_token_budget(model_dir):
    model = _load(model_dir, train=False)
    feats = [model.preprocess(random_texts(12, seed=k)) for k in range(2)]
    loss = st_cached_losses.CachedMNRLoss(model, mini_batch_num_tokens="auto", mini_batch_memory_budget="1GB")
    explicit = st_cached_losses.CachedMNRLoss(model, mini_batch_size=3)
    _, grads, _, _ = _step(model, loss, feats)
    _, ref, _, _ = _step(model, explicit, feats)
    assert loss.cache.auto_size is not None and loss.cache.auto_size > 100
    assert (grads - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_auto_needs_a_budget_off_cuda(model_dir):
    model = _load(model_dir, train=False)
    feats = [model.preprocess(random_texts(4, seed=k)) for k in range(2)]
    if torch.cuda.is_available():  # the model on the CPU of a CUDA machine: refused at its first step
        loss = st_cached_losses.CachedMNRLoss(model, mini_batch_size="auto")
        with pytest.raises(ValueError, match="mini_batch_memory_budget"):
            loss(feats, None)
    else:  # no CUDA anywhere: refused when built (tests/losses/test_messages.py)
        with pytest.raises(ValueError, match="mini_batch_memory_budget"):
            st_cached_losses.CachedMNRLoss(model, mini_batch_size="auto")
    with pytest.raises(ValueError, match="mini_batch_size must be a positive integer or 'auto'"):
        st_cached_losses.CachedMNRLoss(model, mini_batch_size="big")


def _graph_bytes_per_mini_batch(model, loss, feats) -> list[int]:
    """What each mini-batch of the loss's plan for these columns holds in graph (the engine's meter)."""
    from st_cached_losses.engine.features import position_shift_invariant

    trim = position_shift_invariant(model)
    sizes = []
    for k, f in enumerate(feats):
        for mb in loss.cache.plan(k, f, trim_leading=trim):
            out: list[int] = []
            with GraphMeter(model).measure(torch.device("cpu"), out):
                model(dict(mb.features))["sentence_embedding"]
            sizes.append(out[0])
    return sizes


@pytest.mark.parametrize("setting", ["mini_batch_size", "mini_batch_num_tokens"])
def test_auto_re_sizes_for_longer_rows_and_keeps_the_budget(model_dir, setting, caplog):
    """A first batch of short texts, then one of 60-word texts: sized once from the first batch, a
    mini-batch of the second would hold 16x its budget. Re-sized (logged) for the longer rows, every
    mini-batch of every step stays within 1.25x the budget, and the gradients are still the full batch's."""
    model = _load(model_dir, train=False)
    budget = 1_200_000  # about 6 rows of 60 words, 60 rows of 3
    short = [model.preprocess(random_texts(16, seed=k, min_words=1, max_words=3)) for k in range(2)]
    long = [model.preprocess(random_texts(16, seed=10 + k, min_words=55, max_words=60)) for k in range(2)]
    assert long[0]["input_ids"].shape[1] > 5 * short[0]["input_ids"].shape[1]
    loss = st_cached_losses.CachedMNRLoss(model, mini_batch_memory_budget=budget, **{setting: "auto"})
    worst = []
    with caplog.at_level("INFO", logger="st_cached_losses.engine.gradcache"):
        for step, feats in enumerate([short, long, short]):
            _, grads, _, _ = _step(model, loss, feats)
            if step == 0:
                first = loss.cache.auto_size
            worst.append(max(_graph_bytes_per_mini_batch(model, loss, feats)) / budget)
            if step == 1:
                explicit = st_cached_losses.CachedMNRLoss(model, mini_batch_size=16)  # one mini-batch
                _, ref, _, _ = _step(model, explicit, feats)
                assert ref.abs().max() > 0
                # fp32 sums over 60-token rows in other groupings: ~1e-5 of the largest entry
                assert (grads - ref).abs().max() <= 5e-5 * ref.abs().max()
    print(f"{setting}: auto {first} -> {loss.cache.auto_size}, worst graph / budget per step {worst}")
    assert max(worst) <= 1.25, worst
    assert loss.cache.auto_size < first  # re-sized for the long rows (and not back for short ones)
    assert sum("re-sized" in r.getMessage() for r in caplog.records) == 1


def test_auto_token_budget_counts_padding(model_dir):
    """A token budget sized 'auto': a column of a few long rows among many short ones. Packed by real
    tokens, a mini-batch holding a long row pads the short rows it packs with it to the long row's
    length, many times the tokens counted; an ``"auto"`` budget (one of memory) counts padded tokens."""
    model = _load(model_dir, train=False)
    budget = 1_200_000
    texts = [
        random_texts(2, seed=20 + k, min_words=55, max_words=60)
        + random_texts(30, seed=30 + k, min_words=1, max_words=3)
        for k in range(2)
    ]
    feats = [model.preprocess(t) for t in texts]
    loss = st_cached_losses.CachedMNRLoss(
        model, mini_batch_num_tokens="auto", mini_batch_memory_budget=budget
    )
    _, grads, _, replays = _step(model, loss, feats)
    assert grads.abs().max() > 0
    # cached (its real tokens would fit in one mini-batch, its padded ones do not): the mini-batches'
    # graphs are not all held at once
    assert replays > 0
    worst = max(_graph_bytes_per_mini_batch(model, loss, feats)) / budget
    print(f"auto tokens {loss.cache.auto_size}, worst graph / budget {worst}")
    assert worst <= 1.25
