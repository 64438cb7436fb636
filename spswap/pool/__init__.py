"""The node-wide weight pool: flat, DMA-aligned weight files on tmpfs."""
