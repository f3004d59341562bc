"""CUDA graphs for exllamav2's decode step: one captured forward pass per batch size.

exllamav2 captures CUDA graphs only inside the C++ modules of quantized (EXL2) weights, and
only up to 32 rows. With fp16 weights every decode step launches ten-odd kernels per layer
from Python, and with EXL2 weights each layer still runs its modules and attention from
Python; at the batch sizes a worker runs, that host time, not the GPU, sets the step time
(docs/PERFORMANCE.md, "On the GPU (exllamav2 engine options)"). With EXL2 weights the model
is loaded with exllamav2's own module graphs off (load_generator's decode_graphs): a module
begins a capture of its own after its 205th call at one shape, which cannot nest in this
one. And exllamav2's EXL2 matmul times its first calls at each small shape with a host wait,
which would break a capture, so those calls run first (settle_gemm_tuning).

Up to 32 rows exllamav2 multiplies from EXL2 weights with a kernel that reads them once per
4 rows; from 33 rows on it dequantizes each matrix and calls cuBLAS. Where the first is the
slower (on an 8B shape, batches of about 20 to 32 rows), a decode step of that many jobs
replays the 33-row graph instead, its spare rows copies of the first job's: they compute
what it computes and write the same keys and values to the same place, and their logits are
dropped. Which sizes take the padded graph is measured when the graphs are captured
(choose_padding).

The dynamic generator's decode call has one shape per batch size (one new token per job,
paged attention through a block table), so it is captured once per batch size at start-up
and replayed. What varies between steps (the new tokens, the block table, the sequence
lengths) is copied into static buffers the graphs read. The new tokens go in as ids when
the embedding table is on the GPU (embedding.py; the graph gathers their rows),
else as rows gathered on the CPU.

Pinned to exllamav2 0.3.2 like the attention hook: another installed version gets no graphs
(graphs_unsupported_reason says so), tests/gpu/test_decode_graphs.py fails if the decode call
or the paged parameters move, and checks that replayed steps give the same tokens and logits
as exllamav2's own forward pass; tests/gpu/test_decode_graphs_exl2.py does the same on EXL2
weights and fails if the matmul's tuning constants move.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from exlq.worker.engines.exllamav2.attention import PINNED_EXLLAMAV2, installed_exllamav2
from exlq.worker.engines.exllamav2.embedding import embedding_device

log = logging.getLogger(__name__)

# The keyword arguments ExLlamaV2DynamicGenerator.iterate_gen passes to forward_chunk for a
# decode step. A call with any other argument set (prefill's preprocess_only, position
# offsets, an abort event, ...) runs eagerly.
_DECODE_KWARGS = frozenset({"attn_params", "cache", "loras", "indexed_embeddings"})

# exllamav2 0.3.2's EXL2 matmul (exllamav2_ext/cuda/q_gemm.cu) tunes its block size for each
# shape of up to EXL2_BLOCK_M_SIZE_MAX rows: it times the shape's first AT_NUM_MEASURE calls
# with CUDA events and waits for each on the host, which invalidates a stream capture. Larger
# shapes take the tuned result of the largest of these.
_TUNED_ROWS = 4
_TUNING_CALLS = 200
# Up to this many rows the EXL2 matmul runs exllamav2's quantized kernel; above, it
# dequantizes into cuBLAS (q_gemm.cu, MAX_Q_GEMM_ROWS in config.h).
_QUANT_KERNEL_ROWS = 32
# A size replays padded only where the padded graph takes less than this share of its own.
_PAD_GAIN = 0.95


class GraphsUnsupported(ValueError):
    """Decode graphs cannot serve this model; the message says why."""


def has_quantized_layers(model: Any) -> bool:
    """Whether any layer after the embedding holds quantized (EXL2) weights."""
    return any(getattr(m, "q_handle", None) is not None for m in model.modules[1:])


def graphs_unsupported_reason(model: Any, cache: Any) -> str | None:
    """Why decode graphs cannot serve this model and cache, or None when they can."""
    installed = installed_exllamav2()
    if installed != PINNED_EXLLAMAV2:
        return f"exllamav2 {installed} is installed; the graphs are written for {PINNED_EXLLAMAV2}"
    from exllamav2 import ExLlamaV2Cache

    if type(cache) is not ExLlamaV2Cache:
        return f"the cache is {type(cache).__name__}, not the fp16 ExLlamaV2Cache"
    if getattr(model, "tp_context", None) is not None:
        return "the model is split by tensor parallelism"
    if has_quantized_layers(model) and not model.config.no_graphs:
        return (
            "the weights are quantized and were loaded with exllamav2's own module graphs on "
            "(load_generator(decode_graphs=True) turns them off)"
        )
    devices = {m.device_idx for m in model.modules[1:]}
    if len(devices) != 1 or devices == {None} or -1 in devices:
        return f"the layers sit on more than one device ({sorted(map(str, devices))})"
    return None


def settle_gemm_tuning(model: Any, stream: Any) -> int:
    """Run each quantized matrix's shape of 1.._TUNED_ROWS rows through exllamav2's tuning
    calls, eagerly, so that no captured call times itself. Returns the calls made (none for
    fp16 weights)."""
    import torch

    shapes: dict[tuple[int, int], Any] = {}
    for module in model.modules:
        for linear in [module, *module.submodules]:
            if getattr(linear, "q_handle", None) is not None and hasattr(linear, "in_features"):
                shapes.setdefault((linear.in_features, linear.out_features), linear)
    calls = 0
    with torch.cuda.stream(stream):
        for (in_features, _), linear in shapes.items():
            for rows in range(1, _TUNED_ROWS + 1):
                x = torch.zeros((rows, in_features), dtype=torch.half, device=stream.device)
                for _ in range(_TUNING_CALLS):
                    linear.forward(x)
                calls += _TUNING_CALLS
    stream.synchronize()
    return calls


def choose_padding(
    replay_ms: Callable[[int], float], sizes: list[int], pad_rows: int
) -> dict[int, int]:
    """The sizes that should replay the `pad_rows` graph, from `replay_ms` (the GPU time of
    one replay of a size's graph): from the largest size below `pad_rows` down, each whose
    padded replay takes under _PAD_GAIN of its own, stopping at the first that does not (a
    smaller batch only gets cheaper)."""
    if pad_rows not in sizes:
        return {}
    padded_ms = replay_ms(pad_rows)
    chosen: dict[int, int] = {}
    for size in sorted((s for s in sizes if s < pad_rows), reverse=True):
        if padded_ms >= _PAD_GAIN * replay_ms(size):
            break
        chosen[size] = pad_rows
    return chosen


class DecodeGraphs:
    """Stands in for `model.forward_chunk`: replays a captured graph for decode calls of up
    to `max_batch` jobs whose block table is at most `max_pages` pages of `page_size` tokens
    wide; every other call goes to exllamav2's own forward pass. GraphsUnsupported if the
    model cannot be captured. With EXL2 weights it also captures a graph of
    _QUANT_KERNEL_ROWS + 1 rows, for the batches that run faster padded to it."""

    def __init__(
        self,
        model: Any,
        cache: Any,
        max_batch: int,
        max_pages: int,
        page_size: int,
        q_len: int = 1,
    ) -> None:
        reason = graphs_unsupported_reason(model, cache)
        if reason is not None:
            raise GraphsUnsupported(reason)
        import torch
        from exllamav2.attn import ExLlamaV2Attention
        from exllamav2.device import get_device_stream, set_device_streams

        self._torch = torch
        self._paged_params = ExLlamaV2Attention.PagedParams
        self._set_streams = set_device_streams
        self.model = model
        self.cache = cache
        self.max_batch = max_batch
        self.max_pages = max_pages
        self._eager = model.forward_chunk
        self._embedding = model.modules[0]
        self._layers = model.modules[1:]
        device_idx = self._layers[0].device_idx
        self._device = torch.device("cuda", device_idx)
        set_device_streams()
        self._stream = get_device_stream(device_idx) or torch.cuda.current_stream(self._device)
        self._page_size = page_size
        # Tokens a job feeds a step: 1 to decode; 1 + the drafted tokens to verify drafts.
        self.q_len = q_len
        self._graphs: dict[int, Any] = {}
        # Batch sizes that replay a larger graph, padded: size -> the graph's size.
        self.padded: dict[int, int] = {}
        self._pad_rows = _QUANT_KERNEL_ROWS + 1 if has_quantized_layers(model) else None
        rows = max(max_batch, self._pad_rows or 0)  # the static buffers' rows
        self._pool = torch.cuda.graph_pool_handle()
        # With the embedding table on the GPU (embedding.py) the graph starts from
        # the token ids and gathers their rows itself; else from the rows, gathered on the CPU.
        self._embed_in_graph = embedding_device(model) == str(self._device)
        input_shape: tuple[int, ...] = (rows, q_len)
        input_dtype = torch.long
        if not self._embed_in_graph:
            probe = self._embedding.forward(torch.zeros((1, 1), dtype=torch.long))
            input_shape, input_dtype = (rows, q_len, probe.shape[-1]), probe.dtype
        gpu = self._device
        self._input = torch.zeros(input_shape, dtype=input_dtype, device=gpu)
        self._block_index = torch.zeros((rows, max_pages), dtype=torch.int32, device=gpu)
        self._seqlens = torch.zeros((rows,), dtype=torch.int32, device=gpu)
        # Staging in pinned memory, so the copies to the GPU are asynchronous; `_copied` marks
        # when the GPU has read them, before the next step may overwrite them.
        self._stage_input = torch.zeros(input_shape, dtype=input_dtype).pin_memory()
        self._stage_block_index = torch.zeros((rows, max_pages), dtype=torch.int32)
        self._stage_block_index = self._stage_block_index.pin_memory()
        self._stage_seqlens = torch.zeros((rows,), dtype=torch.int32).pin_memory()
        self._copied = torch.cuda.Event()
        self._copied.record(self._stream)
        self._logits: Any = None
        self.replays = 0
        self.padded_replays = 0
        self.capture_seconds = 0.0

    # -- capture ------------------------------------------------------------------------

    def capture(self, batch_sizes: list[int] | None = None) -> float:
        """Capture a graph per batch size (default 1..max_batch, and with EXL2 weights the
        padded size), then choose which sizes replay padded; returns the seconds taken.

        Call before any job runs: each size's warm-up pass (and each timed replay) writes
        keys and values for its rows into page 0 at position 0, which no live sequence may
        hold yet.
        """
        torch = self._torch
        started = time.perf_counter()
        sizes = set(batch_sizes or range(1, self.max_batch + 1))
        if self._pad_rows is not None:
            sizes.add(self._pad_rows)
        with torch.inference_mode(), torch.cuda.device(self._device):
            settle_gemm_tuning(self.model, self._stream)
            for size in sorted(sizes, reverse=True):
                self._capture_one(size)
            if self._pad_rows is not None:
                self.use_padding(choose_padding(self._replay_ms, sorted(sizes), self._pad_rows))
        torch.cuda.synchronize(self._device)
        self.capture_seconds = time.perf_counter() - started
        return self.capture_seconds

    def _capture_one(self, batch: int) -> None:
        torch = self._torch
        params = self._static_params(batch)
        with torch.cuda.stream(self._stream):
            # Warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture.
            logits = self._step_forward(batch, params)
            if self._logits is None:
                rows = self._input.shape[0]
                self._logits = torch.empty(
                    (rows, *logits.shape[1:]), dtype=logits.dtype, device=self._device
                )
            self._logits[:batch].copy_(logits)
        self._stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            logits = self._step_forward(batch, params)
            self._logits[:batch].copy_(logits)
        self._graphs[batch] = graph

    def _replay_ms(self, size: int, replays: int = 5) -> float:
        """The GPU time of one replay of `size`'s graph, over the static buffers as they
        stand (every row at page 0, position 0): the mean of `replays` after one more."""
        torch = self._torch
        graph = self._graphs[size]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            graph.replay()
            start.record(self._stream)
            for _ in range(replays):
                graph.replay()
            end.record(self._stream)
        end.synchronize()
        return float(start.elapsed_time(end)) / replays

    def use_padding(self, padded: dict[int, int]) -> None:
        """Replay each size in `padded` from the larger captured graph it names."""
        for size, rows in padded.items():
            if rows <= size or rows not in self._graphs:
                raise ValueError(f"a batch of {size} cannot replay padded to {rows} rows")
        self.padded = dict(padded)

    def _static_params(self, batch: int) -> Any:
        torch = self._torch
        params = self._paged_params(
            batch_size=batch,
            block_index=torch.zeros((batch, self.max_pages), dtype=torch.int32),
            cache_seqlens=torch.zeros((batch,), dtype=torch.int32),
            max_cache_seqlen=0,
            page_size=self._page_size,
            q_len=self.q_len,
        )
        # One job whose pages happen to be consecutive gets exllamav2's "sequential" path,
        # which slices the cache at host-side offsets; a graph must take the block table.
        params.is_sequential = False
        params.block_index = self._block_index[:batch]
        params.cache_seqlens = self._seqlens[:batch]
        return params

    def _step_forward(self, batch: int, params: Any) -> Any:
        """The captured step: from the static input (ids or rows) of `batch` jobs to logits."""
        x = self._input[:batch]
        if self._embed_in_graph:
            x = self._embedding.forward(x)
        return self._layers_forward(x, params)

    def _layers_forward(self, hidden: Any, params: Any) -> Any:
        """Every module after the embedding, as forward_chunk runs them for a decode step."""
        x = hidden
        for module in self._layers:
            x = module.forward(x, cache=self.cache, attn_params=params, past_len=0, loras=None)
        config = self.model.config
        if config.final_logit_softcapping:
            from exllamav2.ext import exllamav2_ext as ext_c

            ext_c.softcap_(x, config.final_logit_softcapping)
        padding = self._layers[-1].padding
        if padding > 0:
            x[:, :, -padding:] = -65504.0
        return x

    # -- replay -------------------------------------------------------------------------

    def install(self) -> None:
        """Route the model's forward_chunk through this object (an instance attribute)."""
        self.model.forward_chunk = self.forward_chunk

    def uninstall(self) -> None:
        self.model.__dict__.pop("forward_chunk", None)

    def forward_chunk(self, input_ids: Any, **kwargs: Any) -> Any:
        if not self._replays(input_ids, kwargs):
            return self._eager(input_ids, **kwargs)
        return self._replay(input_ids, kwargs["attn_params"])

    def _replays(self, input_ids: Any, kwargs: dict[str, Any]) -> bool:
        """Whether a graph replays this call (else it runs eagerly)."""
        if not kwargs.keys() <= _DECODE_KWARGS or kwargs.get("cache") is not self.cache:
            return False
        if kwargs.get("loras") or kwargs.get("indexed_embeddings"):
            return False
        params = kwargs.get("attn_params")
        if not isinstance(params, self._paged_params) or params.page_size != self._page_size:
            return False
        if params.alt_rope_embed or params.rope_offsets is not None:
            return False
        if input_ids.dim() != 2 or input_ids.shape[1] != self.q_len:
            return False
        return self.fits(int(input_ids.shape[0]), int(params.block_index.shape[1]))

    def _replay(self, input_ids: Any, params: Any) -> dict[str, Any]:
        step_input = input_ids if self._embed_in_graph else self._embedding.forward(input_ids)
        logits = self.replay(step_input, params.block_index, params.cache_seqlens)
        return {"logits": logits}

    @property
    def takes_ids(self) -> bool:
        """Whether a replay starts from token ids (the embedding table is on the GPU), so
        that a step's ids may come from tokens the GPU sampled (replay's `carried`)."""
        return self._embed_in_graph

    def fits(self, batch: int, width: int) -> bool:
        """Whether a decode step of `batch` jobs whose block table is `width` pages wide
        replays a graph."""
        return batch in self._graphs and width <= self.max_pages

    def replay(
        self,
        step_input: Any,
        block_index: Any,
        cache_seqlens: Any,
        carried: tuple[Any, Any] | None = None,
    ) -> Any:
        """Replay the graph for a batch of `step_input` rows (ids, or embedded rows where the
        embedding table is in system memory), with its block table and sequence lengths (host
        tensors); returns the step's device logits (batch, 1, vocab), valid until the next
        replay. `carried`: (tokens, rows): ids taken on the device from `tokens` (device) after
        the host's ids are copied, so a step can start from tokens the GPU sampled before the
        host has read them. `rows` is a count k (rows 0..k-1 take tokens[0..k-1], the usual
        step, whose jobs keep their rows: one copy) or a device index (2, n): rows[1] take
        tokens[rows[0]]."""
        batch = int(step_input.shape[0])
        rows = self.padded.get(batch, batch)
        width = int(block_index.shape[1])
        self._copied.synchronize()
        self._stage_input[:batch].copy_(step_input)
        self._stage_block_index[:batch, :width].copy_(block_index)
        if width < self.max_pages:
            self._stage_block_index[:batch, width:].zero_()
        self._stage_seqlens[:batch].copy_(cache_seqlens)
        if rows > batch:
            # The spare rows repeat the first job: the same keys and values to the same slot.
            self._stage_input[batch:rows].copy_(self._stage_input[0])
            self._stage_block_index[batch:rows].copy_(self._stage_block_index[0])
            self._stage_seqlens[batch:rows].copy_(self._stage_seqlens[0])
            self.padded_replays += 1
        self._set_streams()
        with self._torch.cuda.stream(self._stream):
            self._input[:rows].copy_(self._stage_input[:rows], non_blocking=True)
            self._block_index[:rows].copy_(self._stage_block_index[:rows], non_blocking=True)
            self._seqlens[:rows].copy_(self._stage_seqlens[:rows], non_blocking=True)
            self._copied.record(self._stream)
            if carried is not None:
                tokens, index = carried
                ids = self._input[:, 0]
                if isinstance(index, int):
                    ids[:index].copy_(tokens[:index])
                else:
                    ids.index_copy_(0, index[1], tokens.index_select(0, index[0]))
                if rows > batch:
                    self._input[batch:rows].copy_(self._input[:1].expand(rows - batch, -1))
            self._graphs[rows].replay()
        self.replays += 1
        return self._logits[:batch]


def decode_graphs_for(generator: Any, max_batch: int, q_len: int = 1) -> DecodeGraphs:
    """DecodeGraphs, not yet captured, for a paged generator's model and cache: up to
    `max_batch` jobs of `q_len` tokens a step, block tables as wide as its longest
    sequence. GraphsUnsupported if the model cannot be captured."""
    max_pages = -(-generator.max_seq_len // generator.page_size)
    return DecodeGraphs(
        generator.model, generator.cache, max_batch, max_pages, generator.page_size, q_len
    )


def install_decode_graphs(generator: Any, max_batch: int) -> DecodeGraphs | None:
    """Capture decode graphs for `generator`'s model, or say in the log why not. A drafting
    generator gets its model's graphs for the verify step (each job feeds its last token and
    the drafted ones) and its draft model's for the draft steps."""
    if not generator.paged:
        log.info("CUDA graphs off: the generator is not in paged mode")
        return None
    drafted = int(getattr(generator, "num_draft_tokens", 0))
    try:
        graphs = decode_graphs_for(generator, max_batch, q_len=1 + drafted)
    except GraphsUnsupported as exc:
        log.info("CUDA graphs off: %s", exc)
        return None
    if getattr(generator, "draft_model", None) is not None:
        _install_draft_graphs(generator, max_batch)
    return _capture(generator, graphs, max_batch)


def _install_draft_graphs(generator: Any, max_batch: int) -> None:
    """The draft model's one-token steps, replayed from graphs of their own."""
    max_pages = -(-generator.max_seq_len // generator.page_size)
    try:
        graphs = DecodeGraphs(
            generator.draft_model, generator.draft_cache, max_batch, max_pages, generator.page_size
        )
    except GraphsUnsupported as exc:
        log.info("CUDA graphs off for the draft model: %s", exc)
        return
    _capture(generator, graphs, max_batch)


def _capture(generator: Any, graphs: DecodeGraphs, max_batch: int) -> DecodeGraphs | None:
    try:
        seconds = graphs.capture()
    except Exception as exc:  # a model whose layers cannot be captured still serves eagerly
        log.warning(
            "CUDA graphs off: capture failed (%s: %s); serving with exllamav2's own forward pass",
            type(exc).__name__,
            exc,
        )
        generator.reset_page_table()
        return None
    graphs.install()
    # The warm-up passes wrote into page 0: forget any page the generator might reuse.
    generator.reset_page_table()
    log.info(
        "CUDA graphs on: %s captured for batch sizes 1..%d (block table %d pages) in %.1f s",
        "decode" if graphs.q_len == 1 else f"{graphs.q_len} tokens a job",
        max_batch,
        graphs.max_pages,
        seconds,
    )
    if graphs.padded:
        log.info(
            "CUDA graphs: batches of %d..%d jobs replay padded to %d rows (the EXL2 matmul's "
            "dequantized path measured faster there)",
            min(graphs.padded),
            max(graphs.padded),
            max(graphs.padded.values()),
        )
    return graphs
