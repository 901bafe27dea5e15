"""``TrainingArguments(load_best_model_at_end=True)``: after the last step and before
``on_train_end`` the Trainer loads the best checkpoint's weights into the model in place
(``Trainer._load_best_model``, run exactly when ``args.load_best_model_at_end`` and
``state.best_model_checkpoint`` is set), so the model the callback reads at train end holds
that checkpoint's weights, not the last step's. `reloaded_best_model` says which checkpoint:
the final snapshot records it (`kfac_stream.snapshot.manifest_types.WeightsFrom`) and the
end-of-train line says it (`kfac_stream.tracking.lines.reloaded_weights_line`)."""

from __future__ import annotations

import os
import re

from ..snapshot.manifest_types import WeightsFrom

#: The Trainer's checkpoint folder name (``PREFIX_CHECKPOINT_DIR`` ``-<global step>``).
CHECKPOINT_DIR_RE = re.compile(r"^checkpoint-(\d+)$")


def reloaded_best_model(args, state) -> WeightsFrom | None:
    """The checkpoint whose weights the Trainer loaded into the model before train end, or
    None: no reload (``load_best_model_at_end`` off or no best checkpoint recorded) or the
    best checkpoint is the last step's (the model holds those weights already).

    The checkpoint's step is read from its folder name (``checkpoint-<step>``), else from
    ``state.best_global_step`` (None if neither gives one)."""
    checkpoint = getattr(state, "best_model_checkpoint", None)
    if not getattr(args, "load_best_model_at_end", False) or checkpoint is None:
        return None
    named = CHECKPOINT_DIR_RE.match(os.path.basename(os.path.normpath(str(checkpoint))))
    step = int(named.group(1)) if named else getattr(state, "best_global_step", None)
    if step is not None and int(step) == int(state.global_step):
        return None
    return WeightsFrom(step=None if step is None else int(step), checkpoint=str(checkpoint),
                       reason="load_best_model_at_end")
