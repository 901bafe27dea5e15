"""Every task of the default-selection suite (``suite.py``, ``suite_default.py``) by name, in
one place: the two tasks of ``uncertainty_classification.py`` adapted (`suite_tasks.Docstring`,
`suite_tasks.Manpage`), the tasks trained from scratch (`suite_tasks.TASKS`) and the
pre-train-then-fine-tune tasks (`finetune_tasks.TASKS`)."""

from __future__ import annotations

from tasks import finetune_tasks, suite_tasks

#: the tasks built from a seed alone, by name: from scratch, then the fine-tunes
SEEDED_TASKS = {**suite_tasks.TASKS, **finetune_tasks.TASKS}
#: the suite's task names, in its order
ALL_TASKS = ["license-fit", "manpage-section", "glyph-digits", "source-small", "docstring-lora",
             "lm-heldout", "encoder-filekind"]
ALL_TASKS += [n for n in SEEDED_TASKS if n not in ALL_TASKS]  # the pre-train-then-fine-tune tasks


def make_task(name: str, seed: int, a, base):
    """Task ``name`` at ``seed``; ``a``: the sizes of ``uncertainty_classification.py``'s two
    tasks (``suite.uc_args``), ``base``: the base LM of ``docstring-lora`` (None elsewhere)."""
    if name == "docstring-lora":
        return suite_tasks.Docstring(seed, a, base)
    if name == "manpage-section":
        return suite_tasks.Manpage(seed, a)
    return SEEDED_TASKS[name](seed)
