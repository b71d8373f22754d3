"""The experiment driver: ``run`` (``python -m specdec.run``: one experiment -> summary.json), ``compose``
(config -> checked RunConfig), ``data`` (prompt sets), ``summary`` and ``theory`` (the figures and what they
predict), ``loggers`` (W&B), ``trace`` / ``replay`` (token traces and offline replay), ``report`` (a sweep's
plots). Sits on top of the library; nothing in the library imports it.
"""
