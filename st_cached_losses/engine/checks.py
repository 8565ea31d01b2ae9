"""The engine's checks: mini-batch sizes and memory budgets, as every layer above accepts or refuses them, and
the rules every layer above applies as the engine does: when caching is off, and which memory budget goes
with ``"auto"`` mini-batches."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from st_cached_losses.engine.caller import user_stacklevel

__all__ = [
    "auto_graph_cap",
    "auto_needs_budget",
    "check_auto_budget",
    "check_mini_batch_num_tokens",
    "check_mini_batch_size",
    "graph_budget",
    "is_auto",
    "memory_bytes",
    "no_token_counts",
    "rows_fit_in_one",
    "warn_caching_off",
]


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


#: a number as a budget may be written: ``6000000000``, ``6e9``, ``2.5e9``, ``1.5``, ``.5``
_NUMBER = r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"


def memory_bytes(value: int | float | str | None, name: str) -> int | None:
    """A memory budget in bytes: None, a positive whole number of bytes (an ``int``, or a ``float`` such as
    ``6e9`` that is one), or a string: a number (``"6000000000"``, ``"2.5e9"``) or a size such as ``"6GB"``
    (10^9 bytes), ``"6GiB"`` (2^30), ``"512MB"``, ``"1.5 GiB"``; the one rule for every budget the package
    accepts.

    A size in a unit above bytes is rounded down to whole bytes (``"1.1KiB"``: 1126); a number of bytes must
    be whole (``0.5`` bytes is refused, not rounded to 0). Every refusal shows the value as given.

    Raises:
        ValueError: for anything else, naming ``name`` and showing ``value``."""
    if value is None:
        return None
    usage = f"{name} must be a positive number of bytes or a size such as '6GB', '512MiB' or '1.5GiB', got {value!r}"
    if isinstance(value, str):
        match = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(f"{usage}.")
        # exact arithmetic: "2.5e9" is 2500000000 bytes, not a float that might round
        amount = Fraction(match.group(1)) * _UNITS[unit]
        whole = _UNITS[unit] > 1  # a size in KB, MiB, ...: whole bytes by rounding down
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{usage}.")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{usage}: not a finite number.")
    else:
        amount, whole = Fraction(value), False
    if amount <= 0:
        raise ValueError(f"{usage}: not positive.")
    if whole:
        amount = Fraction(math.floor(amount))
        if amount == 0:
            raise ValueError(f"{usage}: less than one byte.")
    if amount.denominator != 1:
        raise ValueError(f"{usage}: not a whole number of bytes.")
    return int(amount)


def graph_budget(value: int | float | str | None, name: str = "graph_memory_budget") -> int | str | None:
    """``graph_memory_budget`` as the engine keeps it: None, bytes ([`memory_bytes`][st_cached_losses.engine.checks.memory_bytes]'s
    forms), ``"auto"`` (what the device has free, see
    [`AutoGraphBudget`][st_cached_losses.engine.graph_budget.AutoGraphBudget]) or ``"auto:<size>"``, ``"auto"``
    capped at a size (``"auto:20GB"``, kept as ``"auto:20000000000"``).

    Raises:
        ValueError: for anything else, naming ``name`` and showing ``value``."""
    if isinstance(value, str) and value.strip().lower().startswith("auto"):
        rest = value.strip()[4:].strip()
        if not rest:
            return "auto"
        if rest.startswith(":"):
            try:
                return f"auto:{memory_bytes(rest[1:], name)}"
            except ValueError:
                pass
        raise ValueError(
            f"{name} must be 'auto', 'auto:' and a size (a cap, such as 'auto:20GB'), a positive number of "
            f"bytes or a size such as '6GB', got {value!r}."
        )
    try:
        return memory_bytes(value, name)
    except ValueError as exc:
        raise ValueError(
            f"{exc} Or 'auto': what the device has free (e.g. 'auto', or 'auto:20GB' capped)."
        ) from None


def auto_graph_cap(value: int | str | None) -> tuple[bool, int | None]:
    """Whether a ``graph_memory_budget`` as [`graph_budget`][st_cached_losses.engine.checks.graph_budget] keeps it
    is ``"auto"``, and its cap in bytes (None: none)."""
    if not isinstance(value, str):
        return False, None
    _, _, cap = value.partition(":")
    return True, int(cap) if cap else None


def check_mini_batch_size(value: int | str) -> None:
    """A positive ``int``, or ``"auto"`` (sized from a memory budget at the first step)."""
    if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"mini_batch_size must be a positive integer or 'auto', got {value!r}; e.g. 32.")


def check_mini_batch_num_tokens(value: int | str | None) -> None:
    """None, a positive ``int``, or ``"auto"``; sentence-transformers' wording for the int."""
    if value not in (None, "auto") and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(
            f"mini_batch_num_tokens must be a positive integer or None. Got {value!r}; or 'auto' to size it "
            "from a memory budget."
        )


def is_auto(mini_batch_size: int | str, mini_batch_num_tokens: int | str | None) -> bool:
    """Whether the mini-batches are sized to a memory budget (either size setting is ``"auto"``)."""
    return mini_batch_size == "auto" or mini_batch_num_tokens == "auto"


def no_token_counts(mini_batch_num_tokens: int | str | None, features: Mapping[str, Any]) -> ValueError:
    """The error refusing a token budget for a column whose rows' token counts cannot be read."""
    return ValueError(
        f"mini_batch_num_tokens={mini_batch_num_tokens} needs each row's token count, read "
        "from the inputs' 2-D attention_mask (or a flattened column's cu_seq_lens_q), and this "
        f"column has neither (keys {sorted(features)}); "
        "set mini_batch_num_tokens=None and use mini_batch_size instead."
    )


def auto_needs_budget(device: str) -> ValueError:
    """The error refusing ``"auto"`` mini-batches without a memory budget on ``device`` (not CUDA)."""
    return ValueError(
        "mini_batch_size='auto' (or mini_batch_num_tokens='auto') sizes the mini-batches to a memory "
        f"budget: set mini_batch_memory_budget (e.g. '2GB'); on {device} there is no default."
    )


def check_auto_budget(
    mini_batch_size: int | str,
    mini_batch_num_tokens: int | str | None,
    mini_batch_memory_budget: int | str | None,
    *,
    cuda: bool,
) -> None:
    """The one rule of ``mini_batch_memory_budget``, for a loss and for the arguments alike: it sizes
    ``"auto"`` mini-batches only, so without ``"auto"`` it would be unused (refused, naming both fixes); and
    ``"auto"`` without it has a default on CUDA only (half the free memory), so where the run has no CUDA
    device (``cuda`` False) it is refused now rather than at the first step.

    Raises:
        ValueError: naming the settings and the fix."""
    auto = is_auto(mini_batch_size, mini_batch_num_tokens)
    if mini_batch_memory_budget is not None and not auto:
        raise ValueError(
            f"mini_batch_memory_budget={mini_batch_memory_budget!r} sizes 'auto' mini-batches only, and "
            f"mini_batch_size={mini_batch_size!r} is fixed: it would be unused. Set mini_batch_size='auto' (or "
            "mini_batch_num_tokens='auto') to size the mini-batches to it, or remove mini_batch_memory_budget."
        )
    if auto and mini_batch_memory_budget is None and not cuda:
        raise auto_needs_budget("cpu")


def rows_fit_in_one(rows: Sequence[int], rows_per_mini_batch: int) -> bool:
    """The rule of when caching is off, with a row count: the whole batch, every column's rows together
    (``rows``, one count per column), fits in one encoder mini-batch; holding every column's graph at once
    then holds no more than one mini-batch, so caching saves nothing. (With a token budget the engine counts
    tokens instead: [`fits_in_one`][st_cached_losses.engine.planning.MiniBatchPlanner.fits_in_one].)"""
    return sum(rows) <= rows_per_mini_batch


def warn_caching_off(batch: str, setting: str, non_cached: str, note: str = "") -> None:
    """The one warning that caching is off, at the user's line: ``batch`` (what fits, e.g. "the whole batch
    (2 columns, 8 rows together)") fits in one encoder mini-batch of ``setting`` (e.g. "mini_batch_size=32"),
    and ``non_cached``, sentence-transformers' loss that gives the same result without caching (e.g.
    "MultipleNegativesRankingLoss"; a loss without one is not warned about); ``note``: a sentence added at the
    end."""
    warnings.warn(
        f"{batch} fits in one encoder mini-batch ({setting}), so caching is off: caching saves no memory for "
        f"it, and sentence-transformers' {non_cached} (not cached) holds no more than that one mini-batch, "
        f"with the same result. Use a mini-batch smaller than the batch to save memory.{note}",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
