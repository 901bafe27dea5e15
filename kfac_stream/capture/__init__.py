"""Capture: which layers are tracked, which token positions are kept, how rows are gathered."""
