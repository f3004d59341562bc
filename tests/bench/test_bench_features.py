"""The generation-features bench's greedy check: which jobs part from the reference, and
how near a tie the reference's top two were where they did."""

from __future__ import annotations

from bench.features import compare_greedy


def test_greedy_jobs_are_compared_token_by_token_with_the_margin_where_they_part() -> None:
    reference = [[(1, 2.0), (2, 0.5), (3, 1.0)], [(4, 0.01), (5, 3.0)]]
    same = [[(1, 2.1), (2, 0.4), (3, 1.0)], [(4, 0.02), (5, 2.9)]]
    assert compare_greedy(reference, same, against="one GPU") == {
        "greedy_same_as": "one GPU",
        "same_jobs": "2 of 2",
        "margins_where_parted": [],
    }
    # The second job parts at its first token, where the reference's top two lay 0.01 apart.
    parted = [[(1, 2.0), (2, 0.5), (3, 1.0)], [(6, 0.0), (5, 3.0)]]
    result = compare_greedy(reference, parted, against="one GPU")
    assert result["same_jobs"] == "1 of 2" and result["margins_where_parted"] == [0.01]
