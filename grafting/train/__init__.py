"""Training, data sets, experiments and evaluation of the graft (``chimera graft ...``, also
``python -m grafting.train ...``). The served model, the rest of :mod:`grafting`, never imports this package.
"""
