"""Draft methods, one per file. Each subclasses specdec.spec_decode.proposer.Proposer."""
