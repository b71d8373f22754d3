"""Scorers: run the target over the proposals and return its distributions at k+1 positions."""
