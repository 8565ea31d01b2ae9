"""``"auto"`` sizes from forwards at two sizes: a chosen mini-batch's measured peak lands between 60% and 100% of
its budget (the engine's meter: on CPU the bytes autograd saves, deterministic; on CUDA the allocator's peak),
also where a forward has a large fixed cost, which the old one-size probe (one forward of 4 rows, divided
by 4) counted per row and then filled half the budget or less; and ``graph_memory_budget="auto"``: what a
CUDA device has free after the step's needs, nothing elsewhere, the same gradients either way."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import st_cached_losses
from st_cached_losses.engine import auto_size, graph_budget
from st_cached_losses.engine.auto_size import PROBE_ROWS, MemoryFit, fit_memory, pick_mini_batch
from st_cached_losses.engine.features import longest_first, row_lengths
from st_cached_losses.engine.gradcache import GradCache
from st_cached_losses.engine.graph_budget import AUTO_MARGIN, AutoGraphBudget, GraphMeter, choose_kept
from tests.support.tiny_model import make_tiny_model, random_texts

LOW, HIGH = 0.6, 1.0


class PlantedCosts(nn.Module):
    """A toy encoder with a fixed cost per forward (a workspace of ``fixed_floats`` floats that its graph
    keeps) besides a cost per row (its token embeddings). On CPU the meter counts exactly
    ``4 * fixed_floats + rows * length * (4 * width + 8)`` bytes (the workspace, the embeddings, the ids)."""

    def __init__(self, fixed_floats: int, width: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, width)
        self.gain = nn.Parameter(torch.ones(()))
        self.fixed_floats = fixed_floats

    def forward(self, features: dict) -> dict:
        x = self.embedding(features["input_ids"]) * self.gain
        workspace = torch.ones(self.fixed_floats, device=x.device) * self.gain
        return {"sentence_embedding": x.mean(1) + workspace.sum() * 0}


def _on(device: str, features: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}


def _encode(model: nn.Module, features) -> torch.Tensor:
    return model(dict(features))["sentence_embedding"]


def _column(rows: int, length: int, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (rows, length), generator=g)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones(rows, length, dtype=torch.long, device=device),
    }


def _bytes(model, column, rows: torch.Tensor, device: str) -> float:
    """The engine's meter on a forward of ``rows`` (what the probe measures), warmed up on CUDA."""
    if torch.device(device).type == "cuda":
        auto_size._probe(model, column, rows[:1], True, _encode, torch.device(device))
    return auto_size._probe(model, column, rows, True, _encode, torch.device(device))


def _old_probe_choice(model, column, budget: int, device: str) -> int:
    """The one-size probe this replaced: one forward of the PROBE_ROWS heaviest rows, its bytes per row."""
    rows = longest_first(row_lengths(column, len(column["input_ids"])), len(column["input_ids"]))[:PROBE_ROWS]
    return max(int(budget // (_bytes(model, column, rows, device) / len(rows))), 1)


def test_the_line_through_two_sizes_separates_the_fixed_cost():
    fixed, per_row = 5e6, 1e4
    seen: list[int] = []

    def measure(rows):
        seen.append(len(rows))
        return fixed + per_row * len(rows)

    order = torch.arange(10_000)
    fit = fit_memory(measure, order, len, 100_000_000)
    assert fit == MemoryFit(fixed, per_row)
    # 4 rows, then as many as the budget surely holds (4 * budget / m(4)); never more than the budget
    assert seen == [PROBE_ROWS, int(PROBE_ROWS * 1e8 // (fixed + per_row * PROBE_ROWS))]
    assert fixed + per_row * seen[1] <= 1e8
    assert fit.largest_within(100_000_000) == 9_500
    # a fixed cost above the budget: the second forward is one row, the size 1
    seen.clear()
    fit = fit_memory(measure, order, len, 4_000_000)
    assert seen == [PROBE_ROWS, 1] and fit.largest_within(4_000_000) == 1
    # one row to measure: two forwards still (a sharded model's forwards are collectives), the line through 0
    seen.clear()
    fit = fit_memory(measure, order[:1], len, 100_000_000)
    assert seen == [1, 1] and fit == MemoryFit(0.0, fixed + per_row)
    # padded tokens, the lightest rows first (a token budget's second line): the units grow faster than the
    # rows (a mini-batch pads to its widest), and the second forward still stays within the budget
    widths = torch.arange(1, 10_001)
    units: list[int] = []

    def padded(rows):
        return len(rows) * int(widths[rows].max())

    def measure_padded(rows):
        units.append(padded(rows))
        return fixed + per_row * padded(rows)

    fit = fit_memory(measure_padded, order, padded, 100_000_000)
    assert fixed + per_row * units[1] <= 1e8 and units[1] > padded(order[:PROBE_ROWS])
    assert fit.fixed == pytest.approx(fixed) and fit.per_unit == pytest.approx(per_row)
    # noise that makes the line fall: the line through the origin above both points (an overestimate)
    fit = fit_memory(lambda rows: 1e6 if len(rows) == PROBE_ROWS else 0.9e6, order, len, 10**9)
    assert fit == MemoryFit(0.0, 1e6 / PROBE_ROWS)


@pytest.mark.parametrize("by_tokens", [False, True], ids=["rows", "tokens"])
def test_a_planted_fixed_cost_fails_the_old_probe_and_not_the_new(device, by_tokens):
    """A fixed workspace of 1 MiB per forward (on CUDA its peak holds it twice, as it is made) besides a small
    cost per row (576 bytes on CPU), a budget of twice a one-row forward: the old probe counted the workspace
    per row and chose about 8 rows, half the budget; the line through two sizes takes thousands of rows
    and lands within 60-100% of the budget."""
    model = PlantedCosts(fixed_floats=2**18).to(device)
    column = _column(4096, 8, device)
    budget = int(2 * _bytes(model, column, torch.arange(1), device))
    size = pick_mini_batch(model, [column], True, budget, by_tokens=by_tokens, encode=_encode)
    rows = size // 8 if by_tokens else size
    assert 1_000 < rows <= 4096, size
    peak = _bytes(model, column, torch.arange(rows), device)
    old = _old_probe_choice(model, column, budget, device)
    old_peak = _bytes(model, column, torch.arange(old), device)
    print(
        f"{device} {'tokens' if by_tokens else 'rows'}: budget {budget}, new {size} -> {peak / budget:.3f}, old "
        f"{old} rows -> {old_peak / budget:.3f} of the budget"
    )
    assert LOW * budget <= peak <= HIGH * budget, peak / budget
    assert old_peak < LOW * budget, old_peak / budget


@pytest.mark.parametrize("by_tokens", [False, True], ids=["rows", "tokens"])
def test_a_budget_below_one_row_s_forward_says_so(device, by_tokens):
    """Issue 58: a budget smaller than one row's forward sized to 1 row in silence, and its mini-batches took
    3.0x the budget. Now a warning names the budget, what the heaviest row needs (the fit's bytes of it,
    at least what was measured), and the smallest budget that holds it; the size is still the smallest."""
    model = PlantedCosts(fixed_floats=16).to(device)
    column = _column(64, 8, device)
    one_row = _bytes(model, column, torch.arange(1), device)
    budget = int(one_row / 3)
    with pytest.warns(UserWarning) as caught:
        size = pick_mini_batch(model, [column], True, budget, by_tokens=by_tokens, encode=_encode)
    (warning,) = [w for w in caught if "one row's forward needs" in str(w.message)]
    text = str(warning.message)
    setting = "mini_batch_num_tokens" if by_tokens else "mini_batch_size"
    assert text.startswith(f"{setting}='auto': one row's forward needs "), text
    assert f"more than mini_batch_memory_budget={budget:,} B" in text, text
    needs = int(text.split("one row's forward needs ")[1].split(" B")[0].replace(",", ""))
    assert one_row <= needs <= 1.01 * one_row, (needs, one_row)
    assert f"at least {needs:,} B" in text or f"at least {needs + 1:,} B" in text, text
    assert "3.0x the budget" in text, text
    assert warning.filename == __file__  # at the caller's line, not inside the engine
    assert size == (1 if not by_tokens else size) and size >= 1
    if by_tokens:
        assert size < 8 and "a row longer than that is a mini-batch alone" in text
    # a budget that holds a row: no such warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pick_mini_batch(model, [column], True, int(4 * one_row), by_tokens=by_tokens, encode=_encode)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("auto_size") / "bert")
    model[0].auto_model.pooler = None
    return model


@pytest.mark.parametrize("share", [0.05, 0.25])
def test_auto_rows_of_a_real_encoder_land_within_60_to_100_percent(tiny, device, share):
    """The tiny BERT, 256 rows of 4 to 40 words: budgets sized to hold about 5% and 25% of the batch's
    longest rows; the mini-batch of the longest rows at the chosen size measures 60-100% of the budget."""
    model = tiny.to(device)
    column = _on(device, model.preprocess(random_texts(256, seed=3, min_words=4, max_words=40)))
    order = longest_first(row_lengths(column, 256), 256)
    budget = int(_bytes(model, column, order[: int(256 * share)], device))
    size = pick_mini_batch(model, [column], True, budget, by_tokens=False, encode=_encode)
    assert size < 256
    peak = _bytes(model, column, order[:size], device)
    print(f"{device} share {share}: budget {budget}, size {size}, peak {peak / budget:.3f} of the budget")
    assert LOW * budget <= peak <= HIGH * budget, peak / budget


def test_auto_tokens_of_a_real_encoder_land_within_60_to_100_percent(tiny, device):
    """A token budget sized "auto": every mini-batch the planner packs for it stays within the budget, and
    the one of the longest rows (the largest) fills at least 60% of it."""
    model = tiny.to(device)
    column = _on(device, model.preprocess(random_texts(256, seed=4, min_words=4, max_words=40)))
    order = longest_first(row_lengths(column, 256), 256)
    budget = int(_bytes(model, column, order[:32], device))
    cache = GradCache(mini_batch_num_tokens="auto", mini_batch_memory_budget=budget)
    cache.resolve_auto(model, [column], True)
    peaks = [_bytes(model, column, mb.rows.to(device), device) / budget for mb in cache.plan(0, column)]
    print(
        f"{device}: {cache.auto_size} tokens, {len(peaks)} mini-batches, peaks / budget {[round(p, 3) for p in peaks]}"
    )
    assert max(peaks) <= HIGH and peaks[0] >= LOW, peaks


def test_auto_mini_batch_through_the_loss_fits_and_changes_nothing(tiny):
    """Through the loss: two measured forwards (the probe), the chosen size within 60-100% of the budget,
    and the gradients of the same size set by hand, bit for bit."""
    model = tiny.to("cpu")
    feats = [model.preprocess(random_texts(48, seed=k)) for k in range(2)]
    order = longest_first(row_lengths(feats[0], 48), 48)
    budget = int(_bytes(model, feats[0], order[:10], "cpu"))
    auto = st_cached_losses.CachedMNRLoss(model, mini_batch_size="auto", mini_batch_memory_budget=budget)
    forwards = []
    handle = model[0].register_forward_hook(lambda *_: forwards.append(1))
    model.zero_grad(set_to_none=True)
    auto(feats, None).backward()
    handle.remove()
    size = auto.cache.auto_size
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert size is not None and 1 < size < 48
    assert len(forwards) == 2 + 2 * 2 * -(-48 // size) - 1  # probe, stage 1, replays but the last
    explicit = st_cached_losses.CachedMNRLoss(model, mini_batch_size=size)
    model.zero_grad(set_to_none=True)
    explicit(feats, None).backward()
    assert all(
        torch.equal(g, p.grad) for g, p in zip(grads, [p for p in model.parameters() if p.grad is not None])
    )


# --------------------------------------------------------------------------- graph_memory_budget="auto"


def test_auto_graph_budget_leaves_the_steps_needs():
    auto = AutoGraphBudget(available=60 * 10**9, total=80 * 10**9, grads=10**9)
    assert auto.room(2 * 10**9) == 60e9 - AUTO_MARGIN * 80e9 - 1e9 - 2e9
    assert AutoGraphBudget(available=10**9, total=80 * 10**9, grads=0).room(0) == 0


def test_auto_keeps_the_largest_while_the_next_could_still_be_replayed():
    meter = GraphMeter(nn.Linear(1, 1))
    meter.calibrate(100, 1, 1)  # 100 bytes per row
    sizes = [(5, 1), (4, 1), (3, 1), (2, 1)]  # 500, 400, 300, 200 bytes
    # room 1,000: keeping 500 leaves 500 for 400 (replayed beside it); then 400 would need 900 + 300
    assert choose_kept(sizes, meter, math.inf, room=1000) == {0}
    # the step's last graph (200) is held anyway: not chosen, and held beside the kept ones with a replay
    assert choose_kept(sizes, meter, math.inf, room=1200, exempt=3) == {0, 1}  # 900 kept + 300 replayed
    assert choose_kept(sizes, meter, math.inf, room=1100, exempt=3) == {0}
    # a cap: at most 450 kept
    assert choose_kept(sizes, meter, 450, room=10_000) == {1}
    # without room: the plain budget, as before
    assert choose_kept(sizes, meter, 900) == {0, 1}


def _tiny_step(model, loss, feats):
    model.zero_grad(set_to_none=True)
    forwards = []
    handle = model[0].register_forward_hook(lambda *_: forwards.append(1))
    value = loss(feats, None)
    stage1 = len(forwards)
    value.backward()
    handle.remove()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return value.item(), grads, len(forwards) - stage1


def test_auto_graph_budget_keeps_nothing_off_cuda(tiny):
    model = tiny.to("cpu")
    feats = [model.preprocess(random_texts(16, seed=k)) for k in range(2)]
    plain = st_cached_losses.CachedMNRLoss(model, mini_batch_size=4)
    auto = st_cached_losses.CachedMNRLoss(model, mini_batch_size=4, graph_memory_budget="auto")
    v0, g0, r0 = _tiny_step(model, plain, feats)
    v1, g1, r1 = _tiny_step(model, auto, feats)
    assert r0 == r1 == 7 and v0 == v1 and torch.equal(g0, g1)
    assert auto.cache.auto.graph_budget is None and auto.cache.auto.graphs_kept == 0


@pytest.mark.parametrize("free", ["ample", "some", "scarce", "capped"])
def test_auto_graph_budget_from_free_memory_same_gradients(tiny, monkeypatch, free):
    """A device that reports free memory (the CUDA path, its numbers planted on the CPU): with ample memory
    every graph is kept, with some a few, with too little none; a cap keeps fewer. Always the replay path's
    loss and gradients, bit for bit (dropout off: the same forwards either way)."""
    model = tiny.to("cpu")
    feats = [model.preprocess(random_texts(16, seed=k, min_words=6, max_words=30)) for k in range(2)]
    plain = st_cached_losses.CachedMNRLoss(model, mini_batch_size=4)
    v0, g0, r0 = _tiny_step(model, plain, feats)
    # what one mini-batch's graph holds, for the sizes below
    order = longest_first(row_lengths(feats[1], 16), 16)
    one = _bytes(model, feats[1], order[:4], "cpu")
    total = 10**12
    margin = AUTO_MARGIN * total
    available = {
        "ample": margin + 100 * one,
        "some": margin + 5 * one,
        "scarce": margin + one / 2,
        "capped": margin + 100 * one,
    }[free]
    monkeypatch.setattr(graph_budget, "device_memory", lambda device: (int(available), total))
    budget = "auto:" + str(int(2.5 * one)) if free == "capped" else "auto"
    auto = st_cached_losses.CachedMNRLoss(model, mini_batch_size=4, graph_memory_budget=budget)
    v1, g1, r1 = _tiny_step(model, auto, feats)
    kept = auto.cache.auto.graphs_kept
    print(
        f"{free}: budget {auto.cache.auto.graph_budget} (one mini-batch {one:.0f}), kept {kept}, replays {r1} of {r0}"
    )
    assert v1 == v0 and torch.equal(g1, g0)
    assert r1 == r0 - kept
    if free == "ample":
        assert r1 == 0
    elif free == "scarce":
        assert kept == 0 and r1 == r0
    else:
        assert 0 < kept < 7
    if free == "capped":
        assert auto.cache.auto.graph_budget == int(2.5 * one)


@pytest.mark.parametrize("budget", ["auto", "auto:1GB"])
def test_auto_graph_budget_on_the_device(tiny, device, budget):
    """On CUDA (the real device's free memory): graphs are kept, fewer replays, the same loss and gradients
    (to the ordering of CUDA's atomic adds); on CPU: none kept, bit for bit."""
    model = tiny.to(device)
    feats = [_on(device, model.preprocess(random_texts(16, seed=k))) for k in range(2)]
    plain = st_cached_losses.CachedMNRLoss(model, mini_batch_size=4)
    auto = st_cached_losses.CachedMNRLoss(model, mini_batch_size=4, graph_memory_budget=budget)
    v0, g0, r0 = _tiny_step(model, plain, feats)
    v1, g1, r1 = _tiny_step(model, auto, feats)
    assert g0.abs().max() > 0
    if device == "cuda":
        assert r1 < r0 and auto.cache.auto.graphs_kept > 0
        assert v1 == pytest.approx(v0, rel=1e-6)
        assert (g1 - g0).abs().max() <= 1e-5 * g0.abs().max()
    else:
        assert r1 == r0 and v1 == v0 and torch.equal(g1, g0)
    model.to("cpu")


def test_graph_budget_settings():
    from st_cached_losses.engine.checks import auto_graph_cap
    from st_cached_losses.engine.checks import graph_budget as parse

    assert parse("auto") == "auto" and parse(" AUTO ") == "auto"
    assert parse("auto:20GB") == "auto:20000000000" and parse("auto: 1GiB") == f"auto:{2**30}"
    assert parse("6GB") == 6 * 10**9 and parse(None) is None
    assert auto_graph_cap("auto") == (True, None) and auto_graph_cap("auto:5") == (True, 5)
    assert auto_graph_cap(5) == (False, None) and auto_graph_cap(None) == (False, None)
    for bad in ("autos", "auto:", "auto:lots", "auto;1GB", "lots", 0):
        with pytest.raises(ValueError, match="graph_memory_budget must be"):
            parse(bad)
    assert GradCache(graph_memory_budget="auto:1KiB").graph_memory_budget == "auto:1024"


def test_auto_graph_budget_through_the_loss_and_the_arguments(tiny, tmp_path):
    """The setting as the losses and the arguments take it: kept as the engine normalises it, left out of the
    model card's config (it never changes the result), rebuilt alike, and from a field (CLI / YAML)."""
    from st_cached_losses import CachedLossTrainingArguments
    from st_cached_losses.config.factory import build_loss

    loss = st_cached_losses.CachedMNRLoss(tiny, graph_memory_budget="auto:1GB")
    assert (
        loss.graph_memory_budget == "auto:1000000000" and "graph_memory_budget" not in loss.get_config_dict()
    )
    again = st_cached_losses.CachedMNRLoss(tiny, graph_memory_budget=loss.graph_memory_budget)
    assert again.graph_memory_budget == loss.graph_memory_budget
    loss.graph_memory_budget = "auto"
    assert loss.cache.graph_memory_budget == "auto"
    with pytest.raises(ValueError, match="graph_memory_budget must be 'auto'"):
        loss.graph_memory_budget = "auto:plenty"
    args = CachedLossTrainingArguments(output_dir=str(tmp_path / "out"), graph_memory_budget="auto:2GiB")
    assert build_loss(tiny, args).graph_memory_budget == f"auto:{2 * 2**30}"
