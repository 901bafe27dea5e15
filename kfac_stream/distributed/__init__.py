"""Everything that knows about ranks. The only package allowed to import torch.distributed."""
