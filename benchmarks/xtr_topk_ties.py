"""XTR ties: how often does ``torch.topk`` keep the lowest-index copies of tied document tokens?

sentence-transformers' ``xtr_scores`` picks each query token's ``top_k`` document tokens with
``torch.topk(..., sorted=False)`` over the flat ``documents x tokens`` row; our streaming ``xtr_top_keys``
keeps, among tokens tied at the ``top_k``-th similarity, those of the lowest (document, token) index. Exact
ties arise when a document repeats in the batch: here a hard negative shared by every row. For batches 2 to
32 and ``top_k`` 1 to 1597 (every case whose boundary falls inside a group of tied tokens), this counts the
cases and the tied query tokens where ``torch.topk`` (CPU) kept exactly the lowest-index copies (what
``XTR(ties="lowest")``, and the ring, retrieve), and those where ``xtr_top_keys(..., flat_ties=True)`` (the
default ``XTR(ties="topk")`` on one process or gathered) retrieves exactly their tokens.

Run: ``.venv/bin/python benchmarks/xtr_topk_ties.py`` (a few seconds; prints one line).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from st_cached_losses.functional.representations.multi_vector import (
    _TOKEN_BITS,
    XTR,
    pack_tokens,
    xtr_top_keys,
)

H, QUERY_TOKENS, DOC_TOKENS = 16, 4, 6
BATCHES = (2, 4, 8, 16, 32)
TOP_KS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597)


def main() -> None:
    torch.manual_seed(0)
    cases = cases_lowest = tokens = tokens_lowest = tokens_ours = cases_ours = 0
    for batch in BATCHES:
        for top_k in TOP_KS:
            q = F.normalize(torch.randn(batch, QUERY_TOKENS, H), dim=-1)
            positives = F.normalize(torch.randn(batch, DOC_TOKENS, H), dim=-1)
            shared = F.normalize(torch.randn(1, DOC_TOKENS, H), dim=-1).expand(batch, DOC_TOKENS, H)
            documents = torch.stack([positives, shared], dim=1).reshape(-1, H)  # their (Q, N, td) order
            rows = q.reshape(-1, H) @ documents.T  # one row per query token
            if top_k >= rows.shape[-1]:
                continue
            values, picked = rows.topk(top_k, dim=-1, sorted=False)
            ones = torch.ones(batch, DOC_TOKENS)
            columns = XTR(top_k).with_column_data([pack_tokens(positives, ones), pack_tokens(shared, ones)])
            _, keys = xtr_top_keys(
                pack_tokens(q, torch.ones(batch, QUERY_TOKENS)), columns, top_k, 1 << 24, None, True
            )
            keys = keys.reshape(-1, top_k)
            ours = (keys >> _TOKEN_BITS) * DOC_TOKENS + (keys & ((1 << _TOKEN_BITS) - 1))
            ours_case = True
            kth = values.min(-1, keepdim=True).values
            tied_case, lowest_case = False, True
            for r in range(rows.shape[0]):
                tied = (rows[r] == kth[r]).nonzero().flatten().tolist()
                free = top_k - int((rows[r] > kth[r]).sum())  # slots the tied tokens fill
                if len(tied) <= free:
                    continue  # every tied copy is taken: nothing to choose
                tied_case = True
                tokens += 1
                lowest = sorted(set(picked[r].tolist()) & set(tied)) == tied[:free]
                tokens_lowest += lowest
                lowest_case &= lowest
                same = set(ours[r].tolist()) == set(picked[r].tolist())
                tokens_ours += same
                ours_case &= same
            if tied_case:
                cases += 1
                cases_lowest += lowest_case
                cases_ours += ours_case
    print(
        f"(batch, top_k) cases with a tie at the boundary: {cases}; torch.topk kept the lowest-index copies in "
        f"every tied query token in {cases_lowest}; tied query tokens: {tokens}, lowest-index copies in "
        f"{tokens_lowest}; xtr_top_keys(flat_ties=True) retrieved theirs in every tied query token in {cases_ours} "
        f"cases, in {tokens_ours} tied query tokens (torch {torch.__version__})"
    )


if __name__ == "__main__":
    main()
