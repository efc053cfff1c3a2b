"""Training, data sets, experiments and evaluation of the graft; the served model never imports this package.

``cli`` (``chimera graft ...``, also ``python -m grafting.train``), ``synth`` and ``scenes`` (synthetic data
sets), ``data`` (LLaVA JSONL -> batches), ``pretrain`` (the cpu tower's pretraining), ``loop`` (projector
training), ``mcq``, ``evaluate`` and ``freeform`` (evaluation), ``report`` (tables of the experiments).
"""
