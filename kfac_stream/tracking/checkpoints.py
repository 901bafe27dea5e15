"""The checkpoint protocol of a tracking session: the tracker state rides in every Trainer
checkpoint, and a resumed run restores it.

The state is written beside a checkpoint before the Trainer writes it
(`tracker_state.pending_state_dir`), so a checkpoint is never complete without it, and moved
in (one rename, rank 0) once the Trainer has saved. A save the Trainer decides after the step's
events (``save_strategy="best"`` after an evaluation) gets its state written when it is saved.
"""

from __future__ import annotations

import logging
import os

from ..exceptions import TrackerStateError
from .tracker_state import (
    STATE_DIR,
    commit_pending_state,
    find_tracker_state,
    load_tracker_state,
    pending_state_dir,
    save_tracker_state,
)

logger = logging.getLogger("kfac_stream")


def checkpoint_dir(args, step: int) -> str:
    """The Trainer's checkpoint directory of optimizer step ``step``."""
    return os.path.join(args.output_dir, f"checkpoint-{step}")


class CheckpointProtocol:
    """A session's side of the Trainer's checkpoints (the module docstring)."""

    def __init__(self, session) -> None:
        self.session = session
        self.pending_step: int | None = None  # step whose state waits beside its checkpoint

    def before_checkpoint(self, args, step: int) -> None:
        """Write the tracker state beside the checkpoint the Trainer writes next."""
        s = self.session
        s.wait_for_snapshot()  # the snapshot in flight uses the same process group
        s.tracker.release(s.released())  # the flush below writes in place
        save_tracker_state(s.tracker.export(), pending_state_dir(checkpoint_dir(args, step)),
                           s.comm, step=step, extensions=s.tracker.extension_states())
        self.pending_step = step

    def saved(self, args, step: int) -> None:
        """Move the state written before the checkpoint into it; write it now when the
        Trainer decided this save after the step's events."""
        s = self.session
        s.wait_for_snapshot()  # the snapshot in flight uses the same process group
        checkpoint = checkpoint_dir(args, step)
        if self.pending_step == step:
            if s.comm.rank == 0:
                commit_pending_state(checkpoint)
            s.comm.all_gather(None)
        else:
            s.tracker.release(s.released())  # the flush below writes in place
            save_tracker_state(s.tracker.export(), os.path.join(checkpoint, STATE_DIR),
                               s.comm, step=step, extensions=s.tracker.extension_states())
        self.pending_step = None

    def resume(self, args, state) -> None:
        """Restore the tracker state of the checkpoint a resumed run starts from (the
        session's ``resume_from``, else the Trainer's checkpoint of the resumed step)."""
        s = self.session
        checkpoint = s.options.resume_from or checkpoint_dir(args, state.global_step)
        directory, reasons = find_tracker_state(checkpoint)
        if directory is None:
            if s.options.missing_state == "fresh":
                logger.warning("kfac_stream: resuming at step %d from %s without a tracker "
                               "state (%s); the factors start from zero (missing_state='fresh')",
                               state.global_step, checkpoint, "; ".join(reasons))
                return
            raise TrackerStateError(
                f"kfac_stream: resuming at step {state.global_step} from {checkpoint}, which "
                f"holds no complete tracker state ({'; '.join(reasons)}). Resume from another "
                "checkpoint (Trainer.train(resume_from_checkpoint=<path>)), or start the factors "
                "afresh with KFACStreamCallback(..., missing_state='fresh')")
        logger.info("kfac_stream: %s", load_tracker_state(s.tracker, directory))
        s.comm.all_gather(None)  # every rank has read it before it moves
        if s.comm.rank == 0 and directory != os.path.join(checkpoint, STATE_DIR):
            commit_pending_state(checkpoint)  # a crash left it beside the checkpoint
