"""The benchmarks' task definitions (data and models, nothing measured): the classification
benchmark's two tasks (`uncertainty_tasks`, man-page data in `classification_tasks`), the
suite's tasks (`suite_tasks`: trained from scratch; `finetune_tasks`: pre-trained then
fine-tuned; their item pools in `pools`), every suite task by name in `registry`, and the
data-attribution tasks of ``influence_lds.py`` (`lds_tasks`, what they share in
`lds_common`; dattri's MNIST-10 logistic regression in `mnist_task`, also reproduced by
``mnist_dattri_repro.py``).

Imported as ``tasks.<module>`` with ``benchmarks/`` on ``sys.path`` (as the scripts run). A task
module imports the benchmarks' helpers and `pools`, never the registry or a script.
"""
