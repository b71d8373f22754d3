"""Verification: which drafts to keep, and the next token. ``chain`` (RejectionSampler: lossless;
TypicalAcceptanceSampler: Medusa's, lossy), ``tree`` (the same rule over a token tree: greedy longest
path, or recursive rejection sampling), ``rows`` (greedy / random row bookkeeping both share). A chain is a
tree whose parents are i-1, so ``RejectionSampler`` verifies both. Knows nothing about models or requests.
"""
