"""Shared test setup: tests import the helper modules of tests/support/ by name, and a few test
modules import helpers of another test module by its name (every test file's basename is
unique across the folders, so a name means one file)."""

import os
import sys

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
TEST_DIRS = sorted(root for root, _, files in os.walk(TESTS)
                   if "__pycache__" not in root and any(f.startswith("test_") for f in files))
sys.path[:0] = [os.path.join(TESTS, "support"), *TEST_DIRS]
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# x86 CPUs slow down ~10x on denormal floats, which tiny models' training produces.
torch.set_flush_denormal(True)
# Tiny models gain nothing from intra-op threads; one thread keeps the suite fast under load.
torch.set_num_threads(1)
