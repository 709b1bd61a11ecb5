"""The executor: trains a model with a plan on torch.distributed."""
