"""How a step's adapter tokens are cut into tiles: the host builds the tile table (layers.py)
and the kernels (kernels.py) run one program per tile, so both read the tile height here."""

TILE_ROWS = 32  # the most tokens of one tile (the kernels' BLOCK_M)
# Steps of at most this many tokens take the per-token (BGMV) kernels: on an H100 a step's
# deltas cost 0.73 / 1.03 / 2.56 ms at 1 / 4 / 16 tokens with them and 2.14-4.10 / 2.16-2.49
# / 2.29 ms with the tiles (`python -m bench.lora_kernels`, 2026-11-27)
BGMV_MAX_TOKENS = 8
