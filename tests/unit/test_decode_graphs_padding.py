"""Which decode batches replay the larger EXL2 graph, padded: the sizes where it measured
faster, from the largest down, and no timing spent below the first that is not."""

from __future__ import annotations

import pytest

from exlq.worker.engines.exllamav2.graphs import (
    _PAD_GAIN,
    DecodeGraphs,
    choose_padding,
    has_quantized_layers,
)

PAD = 33


def _kernel_costs() -> dict[int, float]:
    """An EXL2-like cost: the quantized kernel grows with the rows, the padded graph is flat."""
    costs = {size: 4.0 + 0.75 * size for size in range(1, PAD)}  # 19.0 ms at 20 rows
    costs[PAD] = 19.0
    return costs


def test_sizes_whose_padded_replay_is_faster_take_it_and_timing_stops_below_them() -> None:
    costs = _kernel_costs()
    asked: list[int] = []

    def replay_ms(size: int) -> float:
        asked.append(size)
        return costs[size]

    chosen = choose_padding(replay_ms, sorted(costs), PAD)
    faster = {s for s in range(1, PAD) if costs[PAD] < _PAD_GAIN * costs[s]}
    assert faster == set(range(22, PAD))  # 19.0 < 0.95 * (4 + 0.75 s) from 22 rows
    assert chosen == {size: PAD for size in faster}
    # The padded graph once, then 32 down to the first size that stays unpadded (21).
    assert asked == [PAD, *range(PAD - 1, 20, -1)]


def test_nothing_is_padded_when_the_largest_small_batch_is_as_fast() -> None:
    costs = _kernel_costs()
    costs[PAD - 1] = costs[PAD]  # 32 rows as fast as 33: no gain, so none below either
    assert choose_padding(costs.__getitem__, sorted(costs), PAD) == {}


def test_nothing_is_padded_without_a_padded_graph() -> None:
    costs = _kernel_costs()
    del costs[PAD]
    assert choose_padding(costs.__getitem__, sorted(costs), PAD) == {}


class _Module:
    def __init__(self, q_handle: object = None) -> None:
        self.q_handle = q_handle


class _Model:
    def __init__(self, *modules: _Module) -> None:
        self.modules = list(modules)


def test_only_models_with_quantized_layers_get_a_padded_graph() -> None:
    """The padded graph is captured for EXL2 layers; the embedding (module 0) never counts."""
    assert has_quantized_layers(_Model(_Module(), _Module(q_handle=1), _Module()))
    assert not has_quantized_layers(_Model(_Module(), _Module(), _Module()))
    assert not has_quantized_layers(_Model(_Module(q_handle=1), _Module()))


def _captured(*sizes: int) -> DecodeGraphs:
    """Graphs of these sizes, as far as use_padding looks (no GPU: nothing is replayed)."""
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs._graphs = {size: object() for size in sizes}
    graphs.padded = {}
    return graphs


def test_padding_is_refused_onto_a_graph_not_captured_or_not_larger() -> None:
    graphs = _captured(*range(1, PAD + 1))
    graphs.use_padding({20: PAD, 32: PAD})
    assert graphs.padded == {20: PAD, 32: PAD}
    for bad in ({20: PAD + 1}, {PAD: PAD}, {32: 20}):
        with pytest.raises(ValueError, match="cannot replay padded"):
            graphs.use_padding({24: PAD, **bad})
        # A refused choice changes nothing: no size replays from a graph that is not there.
        assert graphs.padded == {20: PAD, 32: PAD}
