"""A Flower / PyTorch app."""
