"""A researcher's own proposer, outside specdec: used as ``method="my_proposer:EchoProposer"``.

It drafts the sequence's last ``k`` tokens again (a poor man's n-gram): right often enough on the tiny
model's repetitive greedy output to be accepted sometimes. Knows only the Proposer contract.
"""

import torch

from specdec.spec_decode.proposer import DraftOutput, Proposer, ProposeBatch


class EchoProposer(Proposer):
    calls = 0  # how many times propose ran (the test checks the plug-in was really used)

    def __init__(self, target, config, repeat_last: bool = False) -> None:  # options.repeat_last
        super().__init__(target, config)
        self.repeat = bool(repeat_last)

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        type(self).calls += 1
        k = batch.k
        rows = [[t[-1]] * k if self.repeat else (t[-k:] + [t[-1]] * k)[:k] for t in batch.token_ids]
        return DraftOutput(token_ids=torch.tensor(rows, dtype=torch.long), probs=None)


class NotAProposer:
    """Has a propose method but does not subclass Proposer: must be refused."""

    def __init__(self, target, config) -> None:
        pass

    def propose(self, batch):
        raise AssertionError("never called")
