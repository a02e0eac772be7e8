"""Read a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
for a Llama-family model, checking everything before any of it reaches a slot.

    adapter_model.safetensors:  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
                                [r, in]   and   ...lora_B.weight  [out, r]

The scale PEFT applies (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora) is kept
beside the tensors and folded into B as it is packed for a slot (engine/lora/layers.py), so a
slot computes x @ A^T @ (scale * B)^T. The tensors stay in the dtype the file holds: the slot's
cast is the one conversion.

Checking an adapter reads only the file's header (every tensor's name, dtype, shape and byte
range): the data is read once, where it goes. An adapter at the slots' full rank is read by
the kernel straight from the file into the pinned slab its slots are copied from (a few
`preadv` calls over up to four threads, `TensorPlace` and `read_into`; engine/lora/layers.py),
with no tensor in between; anything else is read into host tensors first
(`AdapterWeights.tensors`). A file changed between its check and the read is refused.
safetensors' own reader has no way to read into memory the caller owns, so the header is
parsed here (the format is an 8-byte length, a JSON table, then the data). Every failure is
a ValueError whose message names the adapter, the tensor or field, and the numbers.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from microserve.model_config import ModelConfig

# PEFT's module names for the Llama projections, and where each one's rows sit in our fused
# projections (engine/models/llama.py): (fused projection, slice index within it).
TARGET_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                  r"lora_([AB])\.weight$")


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module of `config`'s layers."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


# safetensors' names of the floating-point dtypes an adapter may hold
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16}
_HEADER_MAX = 100 << 20  # bytes: safetensors' own bound on a header


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor's bytes are in its file: [offset, offset + nbytes), row-major."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class AdapterWeights:
    """One adapter, checked: (layer, module) -> (A [r, in], B [out, r]) as the file holds
    them; a slot holds scale * B. `read_adapter` gives `places` (the tensors' bytes in `path`'s
    safetensors file) and reads the tensors only when `tensors()` is called; one made in
    memory gives `weights`."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = None
    places: dict[tuple[int, str], tuple[TensorPlace, TensorPlace]] | None = None
    # the file as it was checked (inode, size, mtime): a file replaced or rewritten before its
    # data is read is refused rather than read at the old header's offsets
    file_id: tuple[int, int, int] | None = None

    def tensors(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """The (A, B) tensors, read from the file on first use (one read of its data)."""
        if self.weights is None:
            order = sorted(self.places)
            flat = [place for key in order for place in self.places[key]]
            buffers = [torch.empty(p.shape, dtype=p.dtype) for p in flat]
            self.read_into([(p, host_bytes(t)) for p, t in zip(flat, buffers)])
            pairs = iter(buffers)
            self.weights = {key: (next(pairs), next(pairs)) for key in order}
        return self.weights

    def read_into(self, targets: list[tuple[TensorPlace, memoryview]]) -> None:
        """Read each place's bytes from the file into its buffer (host memory of the place's
        size: `host_bytes`), with no copy in between: `preadv` calls over runs of places
        adjacent in the file, spread over a few threads (one thread's copy out of the page
        cache ran at ~6.4 GB/s on this project's 2-core machine: 13 ms for a rank-16 adapter
        of Llama-3.1-8B's shape). The calls release the GIL: the step loop runs meanwhile."""
        targets = sorted(targets, key=lambda t: t[0].offset)
        views = [view for _, view in targets]
        for place, view in targets:
            if view.nbytes != place.nbytes:
                raise ValueError(f"a {place.nbytes}-byte tensor read into {view.nbytes} bytes")
        total = sum(place.nbytes for place, _ in targets)
        share = -(-total // _READ_THREADS)  # bytes a thread reads, about
        runs: list[tuple[int, list[memoryview]]] = []  # (file offset, views filled in order)
        end = taken = 0
        for (place, _), view in zip(targets, views):
            if (not runs or place.offset != end or len(runs[-1][1]) == _IOV_MAX
                    or taken >= share):
                runs.append((place.offset, []))
                taken = 0
            runs[-1][1].append(view)
            end, taken = place.offset + place.nbytes, taken + place.nbytes
        fd = os.open(Path(self.path) / "adapter_model.safetensors", os.O_RDONLY)
        try:
            if self.file_id is not None and _file_id(os.fstat(fd)) != self.file_id:
                raise ValueError(f"adapter {self.name!r}: adapter_model.safetensors changed "
                                 "since it was checked; load it again")
            if len(runs) == 1:
                _read_run(fd, runs[0][1], runs[0][0], self.name)
                return
            with ThreadPoolExecutor(min(_READ_THREADS, len(runs))) as pool:
                for done in [pool.submit(_read_run, fd, run, offset, self.name)
                             for offset, run in runs]:
                    done.result()
        finally:
            os.close(fd)


def _file_id(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's memory as bytes (no copy): what `read_into` fills."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("host_bytes needs a contiguous host tensor")
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


_READ_THREADS = max(1, min(4, os.cpu_count() or 1))
# Checking a header is plain Python over every tensor (448 of them, 2-7 ms for a rank-16
# adapter of Llama-3.1-8B's shape): every this many, the loader thread lets the GIL go, so the
# step loop beside it waits ~0.3 ms for it, not up to the interpreter's 5-ms switch interval
_YIELD_EVERY = 64
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _read_run(fd: int, views: list[memoryview], offset: int, name: str) -> None:
    """Fill `views` in order from the file's bytes at `offset` (short reads resumed)."""
    views = [view for view in views if len(view)]
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            raise ValueError(f"adapter {name!r}: adapter_model.safetensors ended early (it "
                             "changed while it was read?)")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if n:
            views = [views[0][n:], *views[1:]]


def resolve_path(path: str, lora_dir: str | None) -> Path:
    """The adapter directory `path` names (relative paths are under `lora_dir`). With a
    `lora_dir`, the path must resolve inside it (symbolic links followed)."""
    if lora_dir is None:
        return Path(path).resolve()
    root = Path(lora_dir).resolve()
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"lora_path {path!r} is outside the adapters directory {root} "
                         "(--lora-dir)")
    return resolved


def read_adapter(name: str, path: Path, config: ModelConfig, max_rank: int) -> AdapterWeights:
    """Read and check the adapter at `path` for a model of `config`, rank at most `max_rank`.
    Tensors come back on the CPU in the file's dtype (the caller casts them into its slot)."""
    cfg = _read_config(name, path)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {name!r}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank}")
    for field in ("use_dora", "fan_in_fan_out"):
        if cfg.get(field):
            raise ValueError(f"adapter {name!r}: {field} is not supported")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise ValueError(f"adapter {name!r}: {field} is not supported (got "
                             f"{cfg[field]!r})")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: bias {cfg['bias']!r} is not supported (none only)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(f"adapter {name!r}: unknown target module(s) {', '.join(unknown)} "
                             f"(supported: {', '.join(TARGET_MODULES)})")
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    places, file_id = _read_places(name, path, config, rank)
    if isinstance(targets, list):  # every targeted layer must be there, whole
        layers = cfg.get("layers_to_transform")
        layers = range(config.num_layers) if layers is None else (
            [layers] if isinstance(layers, int) else layers)
        for layer in layers:
            for module in targets:
                if (layer, module) not in places:
                    raise ValueError(f"adapter {name!r}: target module {module} of layer "
                                     f"{layer} has no lora_A/lora_B tensors")
    return AdapterWeights(name, str(path), rank, scale, places=places, file_id=file_id)


def _read_config(name: str, path: Path) -> dict:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"adapter {name!r}: no adapter_config.json in {path}")
    try:
        cfg = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"adapter {name!r}: {file} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"adapter {name!r}: {file} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type {cfg['peft_type']!r} is not LORA")
    return cfg


def _read_header(name: str, file: Path) -> tuple[dict[str, TensorPlace], tuple[int, int, int]]:
    """The tensors of a safetensors file by name, each place checked to lie inside the file
    and to hold exactly its shape's bytes; and the file's identity (`_file_id`)."""
    with open(file, "rb") as f:
        stat = os.fstat(f.fileno())
        size = stat.st_size
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= length <= min(_HEADER_MAX, size - 8):
            raise ValueError(f"adapter {name!r}: {file} is not a safetensors file (header "
                             f"length {length}, file {size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"adapter {name!r}: {file} has a broken header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"adapter {name!r}: {file} has a broken header (not a JSON object)")
    data, places = 8 + length, {}
    for i, (key, entry) in enumerate(header.items()):
        if i % _YIELD_EVERY == _YIELD_EVERY - 1:
            time.sleep(0)  # the GIL back to the step loop now and then (see _YIELD_EVERY)
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(d) for d in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"adapter {name!r}: {file}: tensor {key!r} has a broken header "
                             f"entry {repr(entry)[:200]}") from None
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ValueError(f"adapter {name!r}: {key!r} has dtype {dtype_name}, not a "
                             f"floating-point one ({', '.join(_DTYPES)})")
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or end - begin != nbytes or begin < 0 or data + end > size:
            raise ValueError(f"adapter {name!r}: {key!r} ({dtype_name} {list(shape)}, "
                             f"{nbytes} bytes) has bytes [{begin}, {end}) of a data section "
                             f"of {size - data}")
        places[key] = TensorPlace(dtype, shape, data + begin, nbytes)
    return places, _file_id(stat)


def _read_places(name: str, path: Path, config: ModelConfig, rank: int
                 ) -> tuple[dict[tuple[int, str], tuple[TensorPlace, TensorPlace]],
                            tuple[int, int, int]]:
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"adapter {name!r}: no adapter_model.safetensors in {path} (.bin "
                         "adapters are not read)")
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, TensorPlace]] = {}
    header, file_id = _read_header(name, file)
    for i, (key, place) in enumerate(header.items()):
        if i % _YIELD_EVERY == _YIELD_EVERY - 1:
            time.sleep(0)
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"adapter {name!r}: unexpected tensor {key!r}")
        layer, module, half = int(m.group(1)), m.group(3), m.group(4)
        if module not in TARGET_MODULES:
            raise ValueError(f"adapter {name!r}: unknown target module {module!r} in "
                             f"{key!r} (supported: {', '.join(TARGET_MODULES)})")
        if layer >= config.num_layers:
            raise ValueError(f"adapter {name!r}: {key!r} is for layer {layer}; the model "
                             f"has {config.num_layers}")
        d_in, d_out = shapes[module]
        want = (rank, d_in) if half == "A" else (d_out, rank)
        if place.shape != want:
            raise ValueError(f"adapter {name!r}: {key!r} has shape {list(place.shape)}, "
                             f"expected {list(want)}")
        halves.setdefault((layer, module), {})[half] = place
    places = {}
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"adapter {name!r}: layer {layer} {module} has no {missing} tensor")
        places[(layer, module)] = (pair["A"], pair["B"])
    if not places:
        raise ValueError(f"adapter {name!r}: {file} holds no LoRA tensors")
    return places, file_id
