"""Train an EAGLE-3 head: ``experiments.train.eagle`` with ``method=eagle3`` (fused low/mid/high target layers,
a reduced draft vocabulary with d2t/t2d, cross-entropy only) and training-time test on by default
(``ttt_steps`` 3: the head is unrolled on its own outputs during training, as in the EAGLE-3 paper).

    python -m experiments.train.eagle3 data=~/.cache/specdec/distill/smollm2-feat out=runs/eagle3 \
        epochs=6 vocab=8192 export=checkpoints/smollm2-135m-instruct-eagle3

Every key of conf/eagle.yaml applies (``resume``, ``ttt_steps``, ``vocab`` = draft_vocab_size, ...);
conf/eagle3.yaml only sets ``method``.
"""

import hydra
from omegaconf import DictConfig

from experiments.train.eagle import run


@hydra.main(version_base="1.3", config_path="conf", config_name="eagle3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
