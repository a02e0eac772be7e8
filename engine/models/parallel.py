"""Tensor parallelism: how one rank's share of the model is cut, and the two collectives a
forward pass needs (`--tensor-parallel-size`; the processes are engine/tp/).

The cut is Megatron's, as vLLM and SGLang make it for Llama:
- column-parallel (each rank a slice of the output rows): q, k, v by attention heads, gate and
  up by rows of the intermediate size; their outputs stay on the rank, and attention and
  SiLU·mul run on the rank's heads and rows alone;
- row-parallel (each rank the matching slice of the input columns): o and down; each rank's
  product is a partial sum, added up across ranks by one all-reduce after each;
- the LM head by vocabulary rows (padded to a multiple of the rank count); each rank's logits
  are gathered, so every rank holds the whole row for the sampler (rank 0 samples);
- KV heads follow the q heads. With fewer KV heads than ranks, each KV head is replicated on
  the size // num_kv_heads ranks whose q heads read it (vLLM's rule), so a rank always holds
  whole KV heads and the paged cache keeps its layout, only with fewer heads;
- the embedding and the norms are replicated: a vocabulary-parallel embedding would need an
  all-reduce per step for a table an 8B model holds in 1 GB (70B: 2 GB of 141), and the tied
  LM head reads its rows of the same table.

So a TP 2 step is two all-reduces per layer plus one gather of the logits; everything else is
the single-GPU code on smaller matrices. `size` 1 is the single-device engine: every
collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from microserve.model_config import ModelConfig

# per decoder layer, the module of each parameter and how it is cut
COLUMN_FUSED = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
ROW = ("o_proj", "down_proj")
COLUMN_PARTS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": "gate",
                "up_proj": "up"}


class CustomAllReduce:
    """The all-reduces a rank uses instead of NCCL for the messages they fit, installed once the
    group is joined: a holder, so the modules built before the join (each keeps the
    TensorParallel it was built with) see them. `small`: engine/tp/allreduce.py's one-shot
    over symmetric memory (decode steps' messages); `large`: engine/tp/exchange.py's
    copy-engine exchange (two ranks, eager prompt steps' messages); each `fits(x)` or None."""

    def __init__(self):
        self.small = None
        self.large = None

    def install(self, small, large=None) -> None:
        self.small, self.large = small, large


class Summing:
    """An all-reduce under way (TensorParallel.all_reduce_async); engine/tp/exchange.py's
    `Exchanging` has the same calls."""

    def __init__(self, x: torch.Tensor, work):
        self.x, self.work = x, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()  # NCCL: the current stream waits; the host goes on
            self.work = None
        return self.x

    def parts(self) -> tuple[torch.Tensor, None]:
        """(the sum, None): no other rank's partial is left to add."""
        return self.wait(), None

    def release(self) -> None:
        pass


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `size`; `group` is the torch.distributed process group the
    collectives run in (None: the default one, which engine/tp/group.py joins); `small` the
    all-reduce of small messages, when one is set up."""

    size: int = 1
    rank: int = 0
    group: Any = None
    custom: CustomAllReduce = field(default_factory=CustomAllReduce, compare=False, repr=False)

    # ---- collectives ------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks (a row-parallel projection's partial products): the sum is
        returned, in x itself (NCCL, the exchange) or in a new tensor (the one-shot)."""
        if self.size > 1:
            small, large = self.custom.small, self.custom.large
            if small is not None and small.fits(x):
                return small(x)
            if large is not None and large.fits(x):
                return large.start(x).wait()
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_async(self, x: torch.Tensor):
        """Start summing x over the ranks: NCCL on its own stream, or the exchange on the copy
        engines (a message the one-shot fits is summed at once). `.wait()` on the result makes
        the current stream wait for the sum and returns it; `.parts()` returns (x, the other
        rank's partial) for a kernel to add, or (the sum, None), and `.release()` follows the
        kernel that read them."""
        if self.size > 1:
            small, large = self.custom.small, self.custom.large
            if large is not None and large.fits(x):
                return large.start(x)
            if small is None or not small.fits(x):
                return Summing(x, dist.all_reduce(x, group=self.group, async_op=True))
        return Summing(self.all_reduce(x), None)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The whole logits [N, vocab_size] from each rank's [N, <= per_rank] slice."""
        if self.size == 1:
            return logits
        per_rank = self.vocab_per_rank(vocab_size)
        if logits.shape[1] < per_rank:  # the last rank's slice of an uneven vocabulary
            logits = torch.nn.functional.pad(logits, (0, per_rank - logits.shape[1]))
        parts = torch.empty(self.size, *logits.shape, dtype=logits.dtype, device=logits.device)
        if logits.is_cuda:
            dist.all_gather_into_tensor(parts, logits.contiguous(), group=self.group)
        else:  # gloo has no all_gather_into_tensor
            dist.all_gather(list(parts.unbind(0)), logits.contiguous(), group=self.group)
        return parts.permute(1, 0, 2).reshape(logits.shape[0], -1)[:, :vocab_size]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x to every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    # ---- the cut ----------------------------------------------------------------------------

    def vocab_per_rank(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def vocab_rows(self, vocab_size: int) -> slice:
        """This rank's rows of the (unpadded) vocabulary."""
        per = self.vocab_per_rank(vocab_size)
        return slice(min(vocab_size, self.rank * per), min(vocab_size, (self.rank + 1) * per))

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes this rank's modules are built with: its heads, KV heads and intermediate
        rows (the vocabulary stays whole: the embedding is replicated)."""
        if self.size == 1:
            return config
        config.check_tensor_parallel(self.size)
        return replace(config, num_heads=config.num_heads // self.size,
                       num_kv_heads=max(1, config.num_kv_heads // self.size),
                       intermediate_size=config.intermediate_size // self.size)

    def _part_rows(self, part: str, config: ModelConfig) -> slice:
        """This rank's rows of one of q, k, v, gate, up (unsharded, HF layout)."""
        d, size, rank = config.head_dim, self.size, self.rank
        if part == "q":
            n = config.num_heads // size * d
            return slice(rank * n, (rank + 1) * n)
        if part in ("k", "v"):
            kv = config.num_kv_heads
            if kv >= size:
                n = kv // size * d
                return slice(rank * n, (rank + 1) * n)
            head = rank * kv // size  # replicated: the KV head this rank's q heads read
            return slice(head * d, (head + 1) * d)
        n = config.intermediate_size // size
        return slice(rank * n, (rank + 1) * n)

    def _row_columns(self, module: str, config: ModelConfig) -> slice:
        """This rank's input columns of o (its q heads) or down (its intermediate rows)."""
        return self._part_rows("q" if module == "o_proj" else "gate", config)

    def shard_checkpoint(self, name: str, tensor: torch.Tensor, config: ModelConfig
                         ) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (HF names: q_proj, k_proj, ...).
        Per-channel fp8 scales follow their weight's rows; per-tensor ones stay whole."""
        if self.size == 1:
            return tensor
        module_path, _, kind = name.rpartition(".")
        module = module_path.rpartition(".")[2]
        per_tensor = kind != "weight" and tensor.numel() == 1
        if module in COLUMN_PARTS and not per_tensor:
            return tensor[self._part_rows(COLUMN_PARTS[module], config)]
        if module in ROW and kind == "weight":
            return tensor[:, self._row_columns(module, config)]
        if module == "lm_head":
            return self._pad_rows(tensor[self.vocab_rows(config.vocab_size)], config)
        return tensor

    def shard_parameter(self, name: str, full: torch.Tensor, config: ModelConfig
                        ) -> torch.Tensor:
        """This rank's part of one of our own (fused) parameters, given whole."""
        if self.size == 1:
            return full
        module = name.rpartition(".")[0].rpartition(".")[2]
        if module in COLUMN_FUSED:
            parts = COLUMN_FUSED[module]
            if module == "qkv_proj":
                q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
                sizes = [q, kv, kv]
            else:
                sizes = [config.intermediate_size] * 2
            return torch.cat([whole[self._part_rows(part, config)]
                              for part, whole in zip(parts, full.split(sizes))])
        if module in ROW:
            return full[:, self._row_columns(module, config)]
        if module == "lm_head":
            return self._pad_rows(full[self.vocab_rows(config.vocab_size)], config)
        return full

    def shard_lora(self, module: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA adapter's (A [r, in], B [out, r]) for HF `module`: a
        column-parallel projection's B by its output rows (A whole: the input is replicated);
        a row-parallel one's A by its input columns (B whole: the delta is a partial sum,
        added up by the all-reduce after the projection like the base's product)."""
        if self.size == 1:
            return a, b
        if module in COLUMN_PARTS:
            return a, b[self._part_rows(COLUMN_PARTS[module], config)]
        return a[:, self._row_columns(module, config)], b

    def _pad_rows(self, rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """The LM head's rows of the last rank padded to the others' count (zero rows: their
        logits are cut off after the gather)."""
        missing = self.vocab_per_rank(config.vocab_size) - rows.shape[0]
        if missing == 0:
            return rows
        return torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])])
