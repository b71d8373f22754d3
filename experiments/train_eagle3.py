"""Train an EAGLE-3 head: ``train_eagle.py`` with ``--method eagle3`` (fused low/mid/high target layers,
a reduced draft vocabulary with d2t/t2d, cross-entropy only) and training-time test on by default
(``--ttt-steps 3``: the head is unrolled on its own outputs during training, as in the EAGLE-3 paper).

    python experiments/train_eagle3.py --data ~/.cache/specdec/distill/smollm2 --out runs/eagle3 \
        --epochs 6 --vocab 8192 --export checkpoints/smollm2-135m-instruct-eagle3

Every flag of train_eagle.py applies (``--resume``, ``--ttt-steps``, ``--vocab`` = draft_vocab_size, ...).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_eagle import main  # noqa: E402

if __name__ == "__main__":
    main(method="eagle3")
