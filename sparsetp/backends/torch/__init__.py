"""PyTorch backend: kernel launches, autograd glue and tensor-parallel layers."""
