"""Pure math on tensors: row formats, second moments, loss-scale recovery, the EMA rule.

No process groups, no hooks, no I/O here.
"""
