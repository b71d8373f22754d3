"""Moved: the EAGLE networks live with their checkpoint formats in ``specdec/heads/eagle.py`` and
``eagle3.py``, the draft sampler in ``specdec/spec_decode/draft_sampling.py``. This shim keeps the training
scripts importing until they move over."""

from specdec.heads import Eagle3Head, EagleHead, HeadConfig, build_head, eagle3_layers, load_head  # noqa: F401
from specdec.spec_decode.draft_sampling import sample_draft  # noqa: F401
