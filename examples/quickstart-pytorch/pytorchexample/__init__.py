"""pytorchexample: A Flower / PyTorch app (Flower's quickstart-pytorch, on local data)."""
