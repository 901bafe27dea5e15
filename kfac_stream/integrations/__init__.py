"""Framework integrations (HF Trainer callback)."""
