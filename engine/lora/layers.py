"""Adapters in fixed slots, applied per token: y = base(x) + delta(x), where a token's delta
uses the adapter in its slot and a base token's is nothing (not a zero product: no work).

Each fused projection of the model (qkv_proj, o_proj, gate_up_proj, down_proj) is wrapped in a
`LoraLinear` holding every slot's weights, zero where a slot is empty or its adapter does not
target a slice. With L slots of max rank R and S slices (q, k, v of qkv_proj):

    a  [L, S*R, in]      the slices' A stacked: one shrink covers the fused projection
    b  [L, out, R]       B as PEFT holds it (scale folded in), slice s in its own rows of the
                         fused output: packing an adapter is plain copies, no transpose

The step's tokens are grouped by slot on the host (`LoraBatch.set_slots`, plain ints from the
scheduler) and each group is computed alone: shrink h = x[group] @ a[slot]^T [n, S*R], then
expand y[group, slice s] += h[:, s] @ b[slot, slice s]^T. On the GPU (and under the Triton
interpreter) two Triton kernels do it from a tile table in static buffers, so CUDA graphs
capture it (engine/lora/kernels.py); elsewhere a torch loop over the present groups does.
A step without adapter tokens runs no LoRA code at all (outside CUDA graphs, which keep the
launches, but their tiles are empty and return at once).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextlib import nullcontext as _no_stream
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.lora.adapter import TARGET_MODULES, AdapterWeights, host_bytes, module_shapes
from engine.lora.host import Layout
from engine.lora.tiles import BGMV_MAX_TOKENS, TILE_ROWS
from engine.models.parallel import TensorParallel
from microserve.model_config import ModelConfig

# our fused projection -> the PEFT modules in its output rows, in order
_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
           "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoraBatch:
    """Which tokens of the forward use which slot, read by every LoraLinear of the model.

    Written by `set_slots` before each forward (the runner's): `groups` (slot -> token
    indices) for the torch path, and the Triton kernels' tile table in static device buffers
    (`rows` [max_tokens], `tiles` [3, max tiles]) sized for the largest step or graph bucket,
    with each token's slot (`slots` [BGMV_MAX_TOKENS], -1 past the step's tokens) for the BGMV
    kernels of few-token steps. The tiles and the slots go over in one copy.
    """

    def __init__(self, max_loras: int, max_tokens: int, device: torch.device):
        self.max_loras = max_loras
        self.device = device
        self.use_triton = False  # set by LoraModel.use_triton_kernels
        self.active = False  # any token of this forward uses an adapter; set by set_slots
        # while CUDA graphs are captured (and their warm-up runs): every LoraLinear launches
        # its kernels whatever `active` says, so graphs hold them; set by `capturing`
        self.launch_always = False
        self.groups: list[tuple[int, torch.Tensor]] = []  # set by set_slots
        self.rows = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.max_tiles = -(-max_tokens // TILE_ROWS) + max_loras
        # [tiles (3 x max_tiles) | slots (BGMV_MAX_TOKENS)]: no tile, every token the base
        table = torch.zeros(3 * self.max_tiles + BGMV_MAX_TOKENS, dtype=torch.int32)
        table[3 * self.max_tiles:] = -1
        table = table.to(device)
        self.tiles = table[: 3 * self.max_tiles].view(3, self.max_tiles)
        self.slots = table[3 * self.max_tiles:]
        self._table = table
        self._tiles_empty = True  # what `tiles` and `slots` hold on the device; set_slots
        # the last slot write's copies (CUDA), which the next forward waits for; set by
        # LoraModel.write_slot, cleared by set_slots
        self.copied: torch.cuda.Event | None = None

    @contextmanager
    def capturing(self):
        """Around CUDA graph capture (the runner's)."""
        self.launch_always = True
        try:
            yield
        finally:
            self.launch_always = False

    def set_slots(self, slots: list[int]) -> None:
        """slots: each token's slot, -1 for the base (plain ints, known when the step is
        planned: no device work to find them)."""
        if self.copied is not None:  # a slot was written since the last forward
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            self.copied = None
        by_slot: dict[int, list[int]] = {}
        for token, slot in enumerate(slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(token)
        self.active = bool(by_slot)
        if not self.use_triton:
            self.groups = [(slot, torch.tensor(rows, device=self.device))
                           for slot, rows in sorted(by_slot.items())]
            return
        rows, starts, lengths, tile_slots = [], [], [], []
        for slot, tokens in sorted(by_slot.items()):
            for i in range(0, len(tokens), TILE_ROWS):
                starts.append(len(rows) + i)
                lengths.append(min(TILE_ROWS, len(tokens) - i))
                tile_slots.append(slot)
            rows += tokens
        pad = self.max_tiles - len(starts)  # empty tiles: the grid's rest returns at once
        few = list(slots) if len(slots) <= BGMV_MAX_TOKENS else []
        table = (starts + [0] * pad + lengths + [0] * pad + tile_slots + [0] * pad
                 + few + [-1] * (BGMV_MAX_TOKENS - len(few)))
        if self.active or not self._tiles_empty:  # a base-only step after another: no copy
            self._table.copy_(_to_device(table, self.device))
            if rows:
                self.rows[: len(rows)].copy_(_to_device(rows, self.device))
        self._tiles_empty = not self.active


@dataclass(frozen=True)
class OneRowDelta:
    """A projection's adapter delta for batch-1 decode, not yet added to its output `out`: its
    GEMV computed the shrink (`part` [S*R], float32), and `add` runs the expand by `b` (one
    small kernel). qkv's is handed to the attention instead, whose RoPE kernel adds it as it
    rotates and stores q, k, v (one kernel boundary fewer a layer; engine/lora/kernels.py
    `qkv_delta_rope_and_store_kv`); an attention that does not fuse it calls `add` first.
    `slots`: the token's slot on the device (-1: none)."""

    part: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    bounds: list[int]
    out: torch.Tensor

    def add(self) -> None:
        """out += the expand (the separate kernel)."""
        from engine.lora.kernels import lora_expand_one_row

        lora_expand_one_row(self.part, self.out, self.b, self.slots, self.bounds)


def _to_device(values, device):
    from engine.device import to_device

    return to_device(values, torch.int32, device)


def slot_tensors(weight: torch.Tensor, loras: int, slices: list[int], rank: int,
                 layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed slots for a projection of `weight`'s shape: a [loras, S*R, in] and b [loras,
    out, R]; with `layers`, that many of each stacked in front ([layers, loras, ...])."""
    lead = () if layers is None else (layers,)
    a = torch.zeros(*lead, loras, len(slices) * rank, weight.shape[1], dtype=weight.dtype,
                    device=weight.device)
    b = torch.zeros(*lead, loras, sum(slices), rank, dtype=weight.dtype, device=weight.device)
    return a, b


class LoraLinear(nn.Module):
    """A projection plus the LoRA deltas of its tokens' slots (see the module's docstring)."""

    def __init__(self, base: nn.Linear, batch: LoraBatch, slices: list[int], rank: int,
                 slots: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`slots`: the (a, b) below to use, zeros (LoraModel keeps every layer's in one
        tensor a projection); default: new ones."""
        super().__init__()
        self.base = base
        self.batch = batch
        self.rank = rank
        self.a, self.b = slots or slot_tensors(base.weight, batch.max_loras, slices, rank)
        self.offsets = [sum(slices[:i]) for i in range(len(slices) + 1)]

    @property
    def weight(self) -> torch.Tensor:  # the base's: what fused kernels and loaders read
        return self.base.weight

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = self.base(x)
        else:  # a CUDA graph's static buffer (LlamaForCausalLM.forward_piece)
            torch.mm(x, self.base.weight.t(), out=out)
        self.add_delta(x, out)
        return out

    def add_delta(self, x: torch.Tensor, out: torch.Tensor,
                  norm: tuple[torch.Tensor, float] | None = None, gated: bool = False) -> None:
        """out += each token's adapter delta for the projection's input x; or, for batch-1
        decode's fused kernels, for the input RMSNorm(x) * weight (norm: (weight, eps)) or
        SiLU(gate) * up of x = [gate | up] (gated)."""
        batch = self.batch
        if not (batch.active or batch.launch_always):
            return
        if batch.use_triton:
            from engine.lora.kernels import lora_shrink_expand

            mode = 1 if norm is not None else 2 if gated else 0
            lora_shrink_expand(x, out, self.a, self.b, batch.rows, batch.tiles,
                               self.offsets[1:-1], mode, norm, batch.slots)
            return
        for slot, rows in batch.groups:
            self._add_group(_input(x[rows], norm, gated), out, slot, rows)

    def one_row_shrink(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For batch-1 decode on the Triton path, when this step may use an adapter: (a,
        part, slots) for the projection's GEMV to compute the shrink in as extra rows
        (engine/kernels/gemv.py), then `one_row_expand`; None otherwise."""
        batch = self.batch
        if not batch.use_triton or not (batch.active or batch.launch_always):
            return None
        part = torch.empty(self.a.shape[1], dtype=torch.float32, device=self.a.device)
        return self.a, part, batch.slots

    def one_row_expand(self, shrink: tuple, out: torch.Tensor) -> None:
        self.one_row_delta(shrink, out).add()

    def one_row_delta(self, shrink: tuple, out: torch.Tensor) -> OneRowDelta:
        """The expand of `one_row_shrink`'s shrink into `out`, to be added (or fused)."""
        return OneRowDelta(shrink[1], self.b, shrink[2], self.offsets[1:-1], out)

    def _add_group(self, x: torch.Tensor, out: torch.Tensor, slot: int, rows: torch.Tensor):
        shrunk = x @ self.a[slot].t()  # [n, S*R]
        r = self.rank
        for s in range(len(self.offsets) - 1):
            lo, hi = self.offsets[s], self.offsets[s + 1]
            out[rows, lo:hi] += shrunk[:, s * r : (s + 1) * r] @ self.b[slot, lo:hi].t()

    def packed_shapes(self) -> list[torch.Size]:
        """The shapes `pack` fills: a slot's a [S*R, in] and b [out, R]."""
        return [self.a.shape[1:], self.b.shape[1:]]

    def pack(self, halves: list[tuple[torch.Tensor, torch.Tensor] | None], scale: float = 1.0,
             into: tuple[torch.Tensor, torch.Tensor] | None = None):
        """One adapter's (A [r, in], B [out, r]) of each slice (None: not a target) laid out
        as a slot holds them, B times `scale`: (a [S*R, in], b [out, R]) on the host, in
        `into` if given (`packed_shapes`, the slot's dtype); None if no slice is a target.
        Only what the adapter does not fill is zeroed (a slice it leaves out, the rows past
        its rank): zeroing whole buffers was half the time of packing a rank-16 adapter."""
        if all(pair is None for pair in halves):
            return None
        a, b = into or (torch.empty(self.a.shape[1:], dtype=self.a.dtype),
                        torch.empty(self.b.shape[1:], dtype=self.b.dtype))
        if _full_rank(halves, self):
            # every slice at the full rank, in the slot's dtype (the common case): three host
            # ops, not three a slice (every op is one more wait for the GIL while the step
            # loop runs beside the loader thread)
            torch.cat([pair[0] for pair in halves], out=a)
            torch.cat([pair[1] for pair in halves], out=b)
            if scale != 1.0:
                b.mul_(scale)  # a 16-bit product is computed in float32, rounded once
            return a, b
        for s, pair in enumerate(halves):
            lo, hi, top = self.offsets[s], self.offsets[s + 1], s * self.rank
            r = 0 if pair is None else pair[0].shape[0]
            if pair is not None:
                a[top : top + r] = pair[0]
                _scaled_into(b[lo:hi, :r], pair[1], scale)
            a[top + r : top + self.rank].zero_()
            b[lo:hi, r:].zero_()
        return a, b

    @torch.no_grad()
    def write_slot(self, slot: int, packed: tuple[torch.Tensor, torch.Tensor] | None):
        """Copy `pack`'s output into `slot` (None: zero it); asynchronous from pinned memory."""
        if packed is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a[slot].copy_(packed[0], non_blocking=True)
            self.b[slot].copy_(packed[1], non_blocking=True)


def _scaled_into(out: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """out = scale * src, rounded once into out's dtype, as float32 math would give it. Where
    src casts to out's dtype exactly (the same dtype, or 16 bits into float32), it is copied
    and scaled in place: no float32 copy of the adapter (half of reading a rank-16 adapter
    of Llama-3.1-8B's shape went to making them)."""
    if scale == 1.0:
        out.copy_(src)
    elif src.dtype == out.dtype or (out.dtype == torch.float32 and src.element_size() == 2):
        out.copy_(src)
        out.mul_(scale)  # a 16-bit tensor's product is computed in float32, rounded once
    else:
        out.copy_(src.float() * scale)


def _input(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None, gated: bool):
    """What the projection multiplies, for add_delta's forms of x (torch path)."""
    if norm is not None:
        weight, eps = norm
        v = x.float()
        return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if gated:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x


# per layer: projection -> LoraLinear.pack's (a, b) on the host, None where nothing is targeted
PackedAdapter = list[dict[str, tuple[torch.Tensor, torch.Tensor] | None]]


class LoraModel:
    """The LoRA side of one model: its LoraLinears by (layer, projection) and the batch.

    Args: model (a LlamaForCausalLM, 16- or 32-bit weights), config, max_loras (slots),
    max_rank, max_tokens (the most tokens in one forward, padding included)."""

    def __init__(self, model: nn.Module, config: ModelConfig, max_loras: int, max_rank: int,
                 max_tokens: int):
        """`config`: the whole model's; a rank of a tensor-parallel model (`model.tp`) holds
        its share of each adapter, in slots shaped like its projections."""
        self.tp, self.whole = model.tp, config
        w = model.model.embed_tokens.weight
        self.batch = LoraBatch(max_loras, max_tokens, w.device)
        shapes = module_shapes(model.config)  # this rank's shapes
        decoder = model.model.layers
        # every layer's slots of a projection in one tensor, [layers, slots, ...] (each
        # LoraLinear's a view of its layer): a slot write copies a chunk of layers at once
        self.slots: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers: list[dict[str, LoraLinear]] = []
        for i, layer in enumerate(decoder):
            wrapped = {}
            for parent in (layer.self_attn, layer.mlp):
                for name, modules in _SLICES.items():
                    base = getattr(parent, name, None)
                    if base is None:
                        continue
                    sizes = [shapes[m][1] for m in modules]
                    if name not in self.slots:
                        self.slots[name] = slot_tensors(base.weight, max_loras, sizes,
                                                        max_rank, len(decoder))
                    a, b = self.slots[name]
                    wrapped[name] = LoraLinear(base, self.batch, sizes, max_rank, (a[i], b[i]))
                    setattr(parent, name, wrapped[name])
            self.layers.append(wrapped)
        self._copy_stream = torch.cuda.Stream(w.device) if w.is_cuda else None
        self.batch_dtype = w.dtype  # the slots'
        # A slab of host memory (engine/lora/host.py) holds a packed adapter in chunks: for
        # each projection, its a (then its b) of as many consecutive layers as fit a piece,
        # stacked, so packing is a few host ops a chunk, not a few a layer and projection
        self.chunks: list[tuple[str, int, range]] = []  # (projection, 0: a / 1: b, layers)
        sizes = []
        for name, proj in self.layers[0].items():
            for half, shape in enumerate(proj.packed_shapes()):
                nbytes = math.prod(shape) * proj.a.element_size()
                per = max(1, Layout.PIECE_BYTES // nbytes)
                for first in range(0, len(self.layers), per):
                    layers = range(first, min(first + per, len(self.layers)))
                    self.chunks.append((name, half, layers))
                    sizes.append(nbytes * len(layers))
        self.layout = Layout(sizes)

    def use_triton_kernels(self, on: bool) -> None:
        """The segmented Triton kernels (on: the GPU, or the interpreter) or the torch loop."""
        self.batch.use_triton = on

    def pack(self, adapter: AdapterWeights, rank: int | None = None,
             slab: list[torch.Tensor] | None = None) -> PackedAdapter:
        """The adapter as the slots of tensor-parallel `rank` (default: this one) hold it, in
        host memory: in `slab` if given (laid out as `self.layout` and `self.chunks` say;
        pinned, a slot write is an asynchronous copy), else in new tensors. Runs in the
        loader thread: no device work."""
        tp = self.tp if rank is None else TensorParallel(self.tp.size, rank)
        chunks = None if slab is None else self._chunk_views(slab)
        if chunks is not None and tp.size == 1 and self._read_into_slab(adapter, chunks):
            return self._slab_packed(chunks)
        weights = adapter.tensors()

        def pairs(i: int, name: str) -> list:
            found = [weights.get((i, module)) for module in _SLICES[name]]
            return [None if pair is None else tp.shard_lora(module, *pair, self.whole)
                    for module, pair in zip(_SLICES[name], found)]

        if chunks is None:
            return [{name: proj.pack(pairs(i, name), adapter.scale)
                     for name, proj in wrapped.items()}
                    for i, wrapped in enumerate(self.layers)]
        packed = self._slab_packed(chunks)
        for name, proj in self.layers[0].items():
            found = [pairs(i, name) for i in range(len(self.layers))]
            if not all(_full_rank(layer, proj) for layer in found):  # layer by layer
                for i, wrapped in enumerate(self.layers):
                    into = packed[i][name]
                    if wrapped[name].pack(found[i], adapter.scale, into) is None:
                        for view in into:  # no target here: the chunk holds zeros
                            view.zero_()
                        packed[i][name] = None
                continue
            for chunk_name, half, layers, chunk in chunks:
                if chunk_name == name:
                    _stack_chunk(chunk, [found[i] for i in layers], proj, half, adapter.scale)
        return packed

    def _slab_packed(self, chunks: list) -> PackedAdapter:
        """`pack`'s answer for a slab: each layer's (a, b) of each projection, views of the
        chunks (`_chunk_views`)."""
        views: list[dict[str, list]] = [{name: [None, None] for name in w} for w in self.layers]
        for name, half, layers, chunk in chunks:
            for i, view in zip(layers, chunk):
                views[i][name][half] = view
        return [{name: tuple(pair) for name, pair in layer.items()} for layer in views]

    def _read_into_slab(self, adapter: AdapterWeights, chunks: list) -> bool:
        """Read an adapter that targets every projection of every layer at the slots' full
        rank, all its tensors of one dtype, from its file straight into the slab's chunks:
        a slot's a and b are the file's A and B laid side by side (engine/lora/adapter.py,
        `read_into`), then B's chunks are scaled in place, a few host ops in all. A file of
        another dtype than the slots' is read into a chunk-shaped buffer first and cast once.
        False, with nothing read, for any other adapter (`pack` takes it apart instead)."""
        places = adapter.places
        if places is None:
            return False
        dtypes = {place.dtype for pair in places.values() for place in pair}
        if len(dtypes) != 1 or any(
                (i, module) not in places or places[(i, module)][0].shape[0] != proj.rank
                for i, wrapped in enumerate(self.layers) for name, proj in wrapped.items()
                for module in _SLICES[name]):
            return False
        (dtype,) = dtypes
        # byte ranges of a few buffers, not a tensor view each: this loop holds the GIL, and
        # 448 views of torch ops took ~5 ms of it (a step beside it waited)
        targets, after = [], []
        for name, half, layers, chunk in chunks:
            proj = self.layers[0][name]
            into = chunk if dtype == chunk.dtype else torch.empty(chunk.shape, dtype=dtype)
            memory = host_bytes(into)
            layer_bytes, row_bytes = memory.nbytes // len(layers), into.shape[-1] * dtype.itemsize
            for j, i in enumerate(layers):
                for s, module in enumerate(_SLICES[name]):
                    place = places[(i, module)][half]
                    lo = s * proj.rank if half == 0 else proj.offsets[s]
                    at = j * layer_bytes + lo * row_bytes
                    targets.append((place, memory[at : at + place.nbytes]))
            scale = adapter.scale if half == 1 else 1.0
            if into is not chunk or scale != 1.0:
                after.append((chunk, into, scale))
        adapter.read_into(targets)
        for chunk, into, scale in after:
            if into is chunk:
                chunk.mul_(scale)  # a 16-bit product is computed in float32, rounded once
            elif scale == 1.0:
                chunk.copy_(into)
            else:  # in float32, rounded once into the slots' dtype, as LoraLinear.pack does
                torch.mul(into.to(torch.float32), scale, out=chunk)
        return True

    def write_slot(self, slot: int, packed: PackedAdapter | None,
                   slab: list[torch.Tensor] | None = None) -> torch.cuda.Event | None:
        """Put a packed adapter into `slot` (None: empty it); `slab`: the slab `pack` packed
        it in, copied a chunk of layers at a time (23 copies for Llama-3.1-8B's shape, not
        256). On CUDA the copies run on a side stream, after the work already queued (a step
        in flight may still read the slot's old adapter), and the next forward waits for
        them on the device (`set_slots`): the host never waits. Returns the copies' event
        (CUDA), after which the host memory may be written again."""
        stream = self._copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.batch.device))
        with torch.cuda.stream(stream) if stream is not None else _no_stream():
            if packed is None:
                for a, b in self.slots.values():
                    a[:, slot].zero_()
                    b[:, slot].zero_()
            elif slab is not None:
                for name, half, layers, chunk in self._chunk_views(slab):
                    into = self.slots[name][half][layers.start : layers.stop, slot]
                    into.copy_(chunk, non_blocking=True)
            else:
                for i, wrapped in enumerate(self.layers):
                    for name, proj in wrapped.items():
                        proj.write_slot(slot, packed[i][name])
            if stream is not None:
                self.batch.copied = torch.cuda.Event()
                self.batch.copied.record(stream)
        return self.batch.copied if stream is not None else None

    def _chunk_views(self, slab: list[torch.Tensor]
                     ) -> list[tuple[str, int, range, torch.Tensor]]:
        """(projection, half, layers, [layers, *packed shape] view) of each of `slab`'s
        chunks, as `self.chunks` and `self.layout` place them."""
        views = []
        for (name, half, layers), (piece, offset) in zip(self.chunks, self.layout.places):
            shape = (len(layers), *self.layers[0][name].packed_shapes()[half])
            nbytes = math.prod(shape) * self.batch_dtype.itemsize
            memory = slab[piece][offset : offset + nbytes]
            views.append((name, half, layers, memory.view(self.batch_dtype).view(shape)))
        return views


def _full_rank(pairs: list, proj: LoraLinear) -> bool:
    """Every slice targeted at the slots' full rank, in their dtype: `_stack_chunk`'s case
    (the common one); anything else packs layer by layer (`LoraLinear.pack`)."""
    return all(pair is not None and pair[0].shape[0] == proj.rank
               and pair[0].dtype == proj.a.dtype and pair[1].dtype == proj.b.dtype
               for pair in pairs)  # fmt: skip


def _stack_chunk(chunk: torch.Tensor, layers: list[list], proj: LoraLinear, half: int,
                 scale: float) -> None:
    """Pack a chunk of consecutive layers' a (half 0: [layers, S*R, in]) or b (half 1:
    [layers, out, R], B times scale) of full-rank slices: one host op a slice (and one
    scale): every op is one more wait for the GIL while the step loop runs beside the
    loader thread."""
    r = proj.rank
    for s in range(len(proj.offsets) - 1):
        if half == 0:
            torch.stack([pairs[s][0] for pairs in layers], out=chunk[:, s * r : (s + 1) * r])
        else:
            lo, hi = proj.offsets[s], proj.offsets[s + 1]
            torch.stack([pairs[s][1] for pairs in layers], out=chunk[:, lo:hi])
    if half == 1 and scale != 1.0:
        chunk.mul_(scale)  # a 16-bit product is computed in float32, rounded once


assert set(TARGET_MODULES) == {m for ms in _SLICES.values() for m in ms}
