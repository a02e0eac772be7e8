"""How a step's adapter tokens are cut into tiles: the host builds the tile table (layers.py)
and the kernels (kernels.py) run one program per tile, so both read the tile height here."""

TILE_ROWS = 32  # the most tokens of one tile (the kernels' BLOCK_M)
