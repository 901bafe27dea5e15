"""Shared test setup: tests import the helper modules in this folder by name."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# x86 CPUs slow down ~10x on denormal floats, which tiny models' training produces.
torch.set_flush_denormal(True)
# Tiny models gain nothing from intra-op threads; one thread keeps the suite fast under load.
torch.set_num_threads(1)
